"""Scenario E: messages appended per second through the trace service, next to what the database
allows, measured in the same run.

Three shapes (issue 17's table), each `appends` messages of `content_chars` characters:

- `sequential`: one session, one writer, one append after the other;
- `sessions`: `writers` sessions with one writer each (each writer its own user), all at once;
- `one_session`: one session, `writers` concurrent writers.

Targets, one after the other, on a fresh PostgreSQL database (`--e-database-url`, else
$TEST_DATABASE_URL) and for the trace service also on SQLite:

- `trace_stream`: `agentmesh serve trace` as its own process (reserved ports,
  AGENTMESH_MESH_SECRET), driven over gRPC with libs.rpc.channel and a Signer as one process of the
  mesh drives it (a runtime with many runs at once): every writer acting as its user, one append after
  the other, all writers sharing ONE libs.clients.MessageAppender (with the Signer: its two
  `AppendMessageStream`s opened as the mesh, each append carrying its writer's user token, the
  appends that queue while a request is answered sent together in the next): the path for writers
  of many messages, and the one issue 17's goals are read on;
- `trace`: the same process and writers, one unary `AppendMessages` of one message per append;
- `grpc_floor`: grpc.health.v1 Check on that same trace process with the same writers: a unary
  call that does nothing, the most any RPC can reach here (not for `one_session`: no session);
- `store`: the same store in this process (no gRPC), which shows what the transport costs;
- `raw_tx`: asyncpg straight, one connection per writer, the transaction the store ran before
  issue 17 (BEGIN, SELECT ... FOR UPDATE, UPDATE traces, INSERT ... RETURNING, COMMIT);
- `raw_stmt`: asyncpg straight, the one statement an append is now (sequence, head and row in one
  round trip, no explicit transaction), one append per statement;
- `raw_insert`: asyncpg straight, single INSERTs of rows whose sequence the writer counts itself
  (no counter, no lock, no head): the ceiling of the table itself (not for `one_session`, whose
  writers would need a lock to share a counter).

After every case the rows are counted in the database: per session the number acknowledged, with
sequences 1..n without gaps and one chain (every parent the sequence before), head = last; a
mismatch is reported under `check` and counts as an error. CPU seconds come from psutil: the trace
process, this process (the load generator, and the store when it runs here) and the PostgreSQL
server's processes, so a figure can be read against a 2-core machine that they all share.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sqlite3
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import asyncpg
import grpc
import psutil

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
SHAPES = ("sequential", "sessions", "one_session")


@dataclass
class Context:
    database_url: str  # the PostgreSQL server to use (a fresh database is created next to it)
    work: Path
    appends: int = 3000  # per case
    writers: int = 50
    content_chars: int = 200
    sqlite: bool = True
    targets: tuple[str, ...] = (
        "trace_stream",
        "trace",
        "grpc_floor",
        "store",
        "raw_tx",
        "raw_stmt",
        "raw_insert",
    )
    progress: Callable[[str], None] = field(default=lambda line: print(line, flush=True))


# --- the writers -------------------------------------------------------------------------------------

Append = Callable[[int, str, str], Awaitable[Any]]  # (writer, owner, session id) -> acknowledged


@dataclass
class Plan:
    """Who appends where: writer i acts as owners[i] on sessions[i], counts[i] times."""

    shape: str
    owners: list[str]
    sessions: list[str]
    counts: list[int]


def plans(shape: str, writers: int, tag: str) -> tuple[list[str], list[tuple[str, int]]]:
    """(the owner of each writer, [(owner, session index)]) of a shape; sessions are made by the caller."""
    if shape == "sequential":
        return [f"e-{tag}-0"], [(f"e-{tag}-0", 0)]
    if shape == "sessions":
        owners = [f"e-{tag}-{i}" for i in range(writers)]
        return owners, [(o, i) for i, o in enumerate(owners)]
    owner = f"e-{tag}-0"
    return [owner] * writers, [(owner, 0)] * writers


def split(total: int, writers: int) -> list[int]:
    base, extra = divmod(total, writers)
    return [base + (1 if i < extra else 0) for i in range(writers)]


async def drive(plan: Plan, append: Append) -> dict[str, Any]:
    """Runs every writer at once; appends/s over the wall time, latency, errors by code."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    acked: Counter[str] = Counter()

    async def writer(i: int) -> None:
        owner, sid = plan.owners[i], plan.sessions[i]
        for _ in range(plan.counts[i]):
            t0 = time.perf_counter()
            try:
                await append(i, owner, sid)
            except grpc.aio.AioRpcError as exc:
                errors[exc.code().name] += 1
                continue
            except Exception as exc:
                errors[type(exc).__name__] += 1
                continue
            latencies.append(time.perf_counter() - t0)
            acked[sid] += 1

    started = time.perf_counter()
    await asyncio.gather(*(writer(i) for i in range(len(plan.owners))))
    wall = time.perf_counter() - started
    return {
        "appends_per_s": len(latencies) / wall if wall else None,
        "acknowledged": len(latencies),
        "wall_s": wall,
        "latency_ms": _dist(latencies),
        "errors": dict(errors),
        "_acked": dict(acked),
    }


def _dist(values: list[float]) -> dict[str, float]:
    from bench.scenarios import dist

    return dist(values, 1000.0)


# --- CPU ---------------------------------------------------------------------------------------------


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads, to the nanosecond (/proc/PID/task/*/schedstat):
    psutil's clock ticks (10 ms) would round 50 backends' few milliseconds each to nothing."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return 0.0
    return total / 1e9


def _postgres_cpu() -> dict[int, float]:
    """CPU seconds of each PostgreSQL server process on this machine (postmaster, backends, writers)."""
    out: dict[int, float] = {}
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["name"] or "").startswith("postgres"):
                out[proc.pid] = _cpu_s(proc.pid)
    return out


def _cpu_of(proc: psutil.Process | None) -> float:
    return _cpu_s(proc.pid) if proc is not None else 0.0


class CpuMeter:
    """CPU seconds of the target process, this process and PostgreSQL over one case (PostgreSQL's
    per process: backends come and go; one that ends during the case is missed)."""

    def __init__(self, postgres: bool, target: psutil.Process | None) -> None:
        self.postgres = postgres
        self.target = target

    def read(self) -> dict[str, Any]:
        from bench.procs import system_busy_s

        return {
            "trace": _cpu_of(self.target),
            "bench": _cpu_s(os.getpid()),
            "postgres": _postgres_cpu() if self.postgres else {},
            "machine": system_busy_s(),
            "wall": time.time(),
        }

    @staticmethod
    def report(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
        wall = after["wall"] - before["wall"]
        spent = {
            "trace": after["trace"] - before["trace"],
            "bench": after["bench"] - before["bench"],
            "postgres": sum(v - before["postgres"].get(pid, 0.0) for pid, v in after["postgres"].items()),
        }
        out: dict[str, Any] = {
            "machine_busy_cores": (after["machine"] - before["machine"]) / wall if wall else None
        }
        for key, seconds in spent.items():
            out[f"{key}_cores"] = seconds / wall if wall else None
            out[f"{key}_ms_per_append"] = 1000 * seconds / n if n else None
        return out


# --- checking what was stored --------------------------------------------------------------------------

CHECK_SQL = """
SELECT s.id, s.last_sequence, s.head_sequence,
       (SELECT count(*) FROM messages m WHERE m.trace_id = s.id) AS n,
       (SELECT count(DISTINCT m.sequence) FROM messages m WHERE m.trace_id = s.id) AS distinct_n,
       (SELECT coalesce(max(m.sequence), 0) FROM messages m WHERE m.trace_id = s.id) AS max_seq,
       (SELECT count(*) FROM messages m WHERE m.trace_id = s.id AND m.sequence > 1
          AND m.parent_sequence IS DISTINCT FROM m.sequence - 1) AS off_chain
FROM traces s WHERE s.id = ANY($1::text[])
"""


def _problems(rows: list[tuple[Any, ...]], acked: dict[str, int], counter: bool) -> list[str]:
    found = {r[0]: r for r in rows}
    out = []
    for sid, n_acked in acked.items():
        r = found.get(sid)
        if r is None:
            out.append(f"{sid}: no session")
            continue
        _, last, head, n, distinct_n, max_seq, off_chain = r
        if n != n_acked or distinct_n != n or max_seq != n:
            out.append(f"{sid}: {n} rows ({distinct_n} distinct, max {max_seq}), {n_acked} acknowledged")
        if counter and (last != n or head != n or off_chain):
            out.append(f"{sid}: last {last}, head {head}, {off_chain} off the chain, {n} rows")
    return out


async def check_pg(url: str, acked: dict[str, int], counter: bool = True) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(CHECK_SQL, list(acked))
    finally:
        await conn.close()
    return _problems([tuple(r) for r in rows], acked, counter)


def check_sqlite(path: Path, acked: dict[str, int]) -> list[str]:
    sql = CHECK_SQL.replace("= ANY($1::text[])", f"IN ({','.join('?' * len(acked))})")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(sql, list(acked)).fetchall()
    return _problems(rows, acked, True)


# --- the targets ----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def fresh_pg_database(admin_url: str) -> AsyncIterator[str]:
    name = f"bench_e_{uuid.uuid4().hex[:10]}"
    admin_url = admin_url.replace("postgresql+asyncpg://", "postgresql://")
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield urlparse(admin_url)._replace(path=f"/{name}").geturl()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def _message(sid: str, content: str) -> Any:
    from agentmesh.trace.v1 import trace_pb2 as tp

    return tp.Message(trace_id=sid, role=tp.MESSAGE_ROLE_USER, content=content)


class TraceProcess:
    """`agentmesh serve trace` on a reserved port; a channel that signs each writer's identity."""

    def __init__(self, work: Path, database_url: str) -> None:
        self.work = work
        self.database_url = database_url
        self.secret = secrets.token_urlsafe(32)
        self.proc: Any = None
        self.channel: Any = None

    async def __aenter__(self) -> TraceProcess:
        from agentmesh.libs.identity import Signer
        from agentmesh.libs.rpc import channel, wait_serving
        from agentmesh.trace.v1 import message_service_pb2_grpc, trace_service_pb2_grpc
        from bench import procs

        data = self.work / ("trace-pg" if self.database_url else "trace-sqlite")
        data.mkdir(parents=True, exist_ok=True)
        for old in data.glob("agentmesh.db*"):
            old.unlink()
        env = procs.mesh_env(
            data,
            AGENTMESH_DATABASE_URL=self.database_url,
            AGENTMESH_MESH_SECRET=self.secret,
            AGENTMESH_LOG_LEVEL="WARNING",
        )
        self.data_dir = data
        self.target = env["AGENTMESH_ADDRESSES__TRACE"]
        cmd = [sys.executable, "-m", "agentmesh.cli", "serve", "trace"]
        self.proc = procs._spawn("trace", cmd, env, data / "trace.log")
        try:
            await wait_serving(self.target, timeout_s=60)
        except TimeoutError:
            self.proc.stop()
            raise RuntimeError(f"the trace service did not start:\n{self.proc.tail()}") from None
        self.channel = channel(self.target, Signer(self.secret.encode()), unary_timeout_s=60)
        self.stub = trace_service_pb2_grpc.TraceServiceStub(self.channel)
        self.messages = message_service_pb2_grpc.MessageServiceStub(self.channel)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.channel is not None:
            await self.channel.close()
        if self.proc is not None:
            self.proc.stop()

    @property
    def psutil(self) -> psutil.Process | None:
        with contextlib.suppress(psutil.Error):
            return psutil.Process(self.proc.popen.pid)
        return None

    async def new_session(self, owner: str) -> str:
        from agentmesh.libs import identity
        from agentmesh.trace.v1 import trace_pb2 as tp
        from agentmesh.trace.v1 import trace_service_pb2 as ts

        with identity.acting_as(owner):
            resp = await self.stub.CreateTrace(ts.CreateTraceRequest(trace=tp.Trace(agent="general")))
        return str(resp.trace.id)

    def append(self, content: str) -> Append:
        from agentmesh.libs import identity
        from agentmesh.trace.v1 import message_service_pb2 as ms

        async def one(_: int, owner: str, sid: str) -> Any:
            request = ms.AppendMessagesRequest(trace_id=sid, messages=[_message(sid, content)])
            with identity.acting_as(owner):
                return (await self.messages.AppendMessages(request)).messages[0]

        return one


class TraceStream:
    """The same trace process, every writer appending through one shared `AppendMessageStream`
    (libs.clients.MessageAppender with a Signer: one stream opened as the mesh, each append with its
    writer's user token)."""

    def __init__(self, trace: TraceProcess) -> None:
        self.trace = trace
        self.appender: Any = None

    @property
    def psutil(self) -> psutil.Process | None:
        return self.trace.psutil

    async def new_session(self, owner: str) -> str:
        return await self.trace.new_session(owner)

    def append(self, content: str) -> Append:
        from agentmesh.libs import identity
        from agentmesh.libs.clients import MessageAppender
        from agentmesh.libs.identity import Signer

        async def one(i: int, owner: str, sid: str) -> Any:
            if self.appender is None:
                signer = Signer(self.trace.secret.encode())
                self.appender = MessageAppender(self.trace.messages, timeout_s=60, signer=signer)
            with identity.acting_as(owner):
                return await self.appender.append(_message(sid, content))

        return one

    async def done(self) -> None:
        """Closes the shared stream (after a case, and after its warm-up)."""
        appender, self.appender = self.appender, None
        if appender is not None:
            await appender.aclose()


class InProcessStore:
    """The trace store of the service, opened in this process on the same database."""

    def __init__(self, database_url: str) -> None:
        self.database_url = database_url

    async def __aenter__(self) -> InProcessStore:
        from agentmesh.services.trace.store.sql import SqlStores
        from agentmesh.services.trace.store.sql.db import create_engine

        self.engine = create_engine(self.database_url)
        self.stores = SqlStores.open(self.engine)
        return self

    async def __aexit__(self, *exc: object) -> None:
        close = getattr(self.stores, "close", None)
        if close is not None:
            await close()
        await self.engine.dispose()

    async def new_session(self, owner: str) -> str:
        from agentmesh.trace.v1 import trace_pb2 as tp

        return str((await self.stores.traces.create_trace(owner, tp.Trace(agent="general"), "")).id)

    def append(self, content: str) -> Append:
        async def one(_: int, owner: str, sid: str) -> Any:
            return await self.stores.messages.append_message(owner, _message(sid, content))

        return one


# The transaction an append ran before issue 17, statement for statement (what SQLAlchemy sent).
RAW_TX = (
    "SELECT id, last_sequence, head_sequence FROM traces WHERE id = $1 AND user_id = "
    "(SELECT id FROM users WHERE name = $2) AND deleted_at IS NULL FOR UPDATE",
    "UPDATE traces SET head_sequence = $1, last_sequence = $2, updated_at = $3 WHERE id = $4",
    "INSERT INTO messages (trace_id, sequence, parent_sequence, role, content, thinking, metadata, "
    "model, input_tokens, output_tokens, sort_order, status, source, a2a_task_id, caller_agent_id, "
    "caller_trace_id, created_at) VALUES ($1, $2, $3, 'user', $4, '', NULL, '', 0, 0, 0, "
    "'completed', 'user', NULL, NULL, NULL, $5) RETURNING id, created_at",
)
RAW_INSERT = (
    "INSERT INTO messages (trace_id, sequence, parent_sequence, role, content, thinking, metadata, "
    "model, input_tokens, output_tokens, sort_order, status, source, created_at) VALUES "
    "($1, $2, $3, 'user', $4, '', NULL, '', 0, 0, 0, 'completed', 'user', $5) RETURNING id"
)


# The store's one-item statement as asyncpg takes it ($n parameters), and its values for a plain
# user message after the head.
ONE_DEFAULTS: dict[str, Any] = {
    "parent": None,
    "role": "user",
    "thinking": "",
    "meta": None,
    "model": "",
    "tin": 0,
    "tout": 0,
    "status": "completed",
    "source": "user",
    "task": "",
    "agent": "",
    "csid": "",
}


def one_statement() -> tuple[str, list[str]]:
    from sqlalchemy.dialects.postgresql import asyncpg as dialect

    from agentmesh.services.trace.store.sql.append_writes import PG_APPEND_ONE

    compiled = PG_APPEND_ONE.compile(dialect=dialect.dialect())
    return str(compiled), list(compiled.positiontup or [])


class HealthFloor:
    """The transport's floor: grpc.health.v1 Check on the same trace process, same writers: what a
    unary call costs the client and the server when it does nothing."""

    def __init__(self, trace: TraceProcess) -> None:
        self.trace = trace

    @property
    def psutil(self) -> psutil.Process | None:
        return self.trace.psutil

    async def new_session(self, owner: str) -> str:
        return f"{owner}-nothing"

    def append(self, content: str) -> Append:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(self.trace.channel)
        request = health_pb2.HealthCheckRequest(service="")

        async def one(_: int, owner: str, sid: str) -> Any:
            return await stub.Check(request)

        return one


class RawPg:
    """asyncpg straight on the same tables: one connection per writer."""

    def __init__(self, url: str, kind: str, writers: int) -> None:
        self.url, self.kind, self.writers = url, kind, writers
        self.conns: list[asyncpg.Connection] = []
        self.next_seq: dict[str, int] = {}

    async def __aenter__(self) -> RawPg:
        self.conns = list(await asyncio.gather(*(asyncpg.connect(self.url) for _ in range(self.writers))))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.close() for c in self.conns), return_exceptions=True)

    async def new_session(self, owner: str) -> str:
        conn = self.conns[0]
        uid = await conn.fetchval(
            "INSERT INTO users (name, created_at) VALUES ($1, now()) ON CONFLICT (name) "
            "DO UPDATE SET name = EXCLUDED.name RETURNING id",
            owner,
        )
        sid = str(uuid.uuid4())
        await conn.execute(
            "INSERT INTO traces (id, user_id, agent, kind, visible_in_sidebar, head_sequence, "
            "last_sequence, title, created_at, updated_at) VALUES ($1, $2, 'general', 'chat', 0, 0, 0, "
            "'', now(), now())",
            sid,
            uid,
        )
        self.next_seq[sid] = 0
        return sid

    def append(self, content: str) -> Append:
        from datetime import UTC, datetime

        if self.kind == "raw_tx":

            async def tx(i: int, owner: str, sid: str) -> Any:
                conn = self.conns[i]
                async with conn.transaction():
                    row = await conn.fetchrow(RAW_TX[0], sid, owner)
                    if row is None:
                        raise LookupError("no session")
                    seq, stamp = row["last_sequence"] + 1, datetime.now(UTC)
                    await conn.execute(RAW_TX[1], seq, seq, stamp, sid)
                    return await conn.fetchrow(
                        RAW_TX[2], sid, seq, row["head_sequence"] or None, content, stamp
                    )

            return tx
        if self.kind == "raw_stmt":
            sql, names = one_statement()

            async def stmt(i: int, owner: str, sid: str) -> Any:
                values = {
                    **ONE_DEFAULTS,
                    "sid": sid,
                    "owner": owner,
                    "content": content,
                    "now": datetime.now(UTC),
                }
                row = await self.conns[i].fetchrow(sql, *(values[n] for n in names))
                if row is None:
                    raise LookupError("no session")
                return row

            return stmt

        async def insert(i: int, owner: str, sid: str) -> Any:
            self.next_seq[sid] += 1  # one writer per session: no race
            seq = self.next_seq[sid]
            return await self.conns[i].fetchval(
                RAW_INSERT, sid, seq, seq - 1 or None, content, datetime.now(UTC)
            )

        return insert


# --- one case ------------------------------------------------------------------------------------------


async def case(
    ctx: Context, target: Any, name: str, shape: str, backend: str, check: Callable[[dict[str, int]], Any]
) -> dict[str, Any]:
    """Sessions for the shape, a short warm-up on sessions of its own, then the measured appends."""
    tag = f"{name}-{shape}-{uuid.uuid4().hex[:6]}"
    writers = 1 if shape == "sequential" else ctx.writers
    owners, slots = plans(shape, writers, tag)
    distinct: dict[tuple[str, int], str] = {}
    for owner, index in slots:
        if (owner, index) not in distinct:
            distinct[(owner, index)] = await target.new_session(owner)
    sessions = [distinct[s] for s in slots]
    content = ("x" * ctx.content_chars)[: ctx.content_chars]
    append = target.append(content)
    # Warm-up: connections opened, statements prepared, on sessions of its own.
    warm_owner = f"e-{tag}-warm"
    warm = await target.new_session(warm_owner)
    await asyncio.gather(*(append(i, warm_owner, warm) for i in range(min(writers, 8))))
    done = getattr(target, "done", None)
    if done is not None:
        await done()
    plan = Plan(shape, owners, sessions, split(ctx.appends, writers))
    meter = CpuMeter(backend == "postgres", getattr(target, "psutil", None))
    before = meter.read()
    out = await drive(plan, append)
    after = meter.read()
    if done is not None:
        await done()
    out["cpu"] = CpuMeter.report(before, after, out["acknowledged"])
    acked = out.pop("_acked")
    problems = await check(acked) if asyncio.iscoroutinefunction(check) else check(acked)
    out["check"] = "ok" if not problems else problems[:5]
    if problems:
        out["errors"]["check"] = len(problems)
    out.update(target=name, shape=shape, backend=backend, writers=writers, sessions=len(distinct))
    lat = out["latency_ms"]
    ctx.progress(
        f"    {backend:8} {name:10} {shape:12} {out['appends_per_s'] or 0:8.0f}/s  "
        f"p50 {lat.get('p50', 0):6.1f} ms  p99 {lat.get('p99', 0):6.1f} ms  "
        f"busy {out['cpu']['machine_busy_cores'] or 0:.2f} cores  check {'ok' if not problems else 'FAILED'}"
        + (f"  errors {out['errors']}" if out["errors"] else "")
    )
    return out


async def run(ctx: Context) -> dict[str, Any]:
    """Every target and shape; returns {cases: [...], table: {backend: {target: {shape: appends/s}}}}."""
    admin = ctx.database_url or os.environ.get("TEST_DATABASE_URL", DEFAULT_PG)
    ctx.work.mkdir(parents=True, exist_ok=True)
    cases: list[dict[str, Any]] = []
    async with fresh_pg_database(admin) as url:
        ctx.database_url = url

        async def checked(acked: dict[str, int]) -> list[str]:
            return await check_pg(url, acked)

        async def checked_rows(acked: dict[str, int]) -> list[str]:
            return await check_pg(url, acked, counter=False)

        def nothing(acked: dict[str, int]) -> list[str]:
            return []

        # The trace service first: it migrates the database that every other target then uses.
        async with TraceProcess(ctx.work, url) as trace:
            if "trace_stream" in ctx.targets:
                stream = TraceStream(trace)
                for shape in SHAPES:
                    cases.append(await case(ctx, stream, "trace_stream", shape, "postgres", checked))
            if "trace" in ctx.targets:
                for shape in SHAPES:
                    cases.append(await case(ctx, trace, "trace", shape, "postgres", checked))
            if "grpc_floor" in ctx.targets:
                floor = HealthFloor(trace)
                for shape in ("sequential", "sessions"):
                    cases.append(await case(ctx, floor, "grpc_floor", shape, "postgres", nothing))
        if "store" in ctx.targets:
            async with InProcessStore(url) as store:
                for shape in SHAPES:
                    cases.append(await case(ctx, store, "store", shape, "postgres", checked))
        for kind in ("raw_tx", "raw_stmt", "raw_insert"):
            if kind not in ctx.targets:
                continue
            for shape in SHAPES:
                if kind == "raw_insert" and shape == "one_session":
                    continue
                writers = 1 if shape == "sequential" else ctx.writers
                async with RawPg(url, kind, writers) as raw:
                    check = checked_rows if kind == "raw_insert" else checked
                    cases.append(await case(ctx, raw, kind, shape, "postgres", check))
    if ctx.sqlite and ("trace" in ctx.targets or "trace_stream" in ctx.targets):
        async with TraceProcess(ctx.work, "") as trace:
            db = trace.data_dir / "agentmesh.db"
            for name, target in (("trace_stream", TraceStream(trace)), ("trace", trace)):
                if name not in ctx.targets:
                    continue
                for shape in SHAPES:
                    cases.append(
                        await case(ctx, target, name, shape, "sqlite", lambda a: check_sqlite(db, a))
                    )
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for c in cases:
        table.setdefault(c["backend"], {}).setdefault(c["target"], {})[c["shape"]] = c["appends_per_s"]
    return {
        "what": (
            f"{ctx.appends} appends of {ctx.content_chars} characters per case; shapes: one session "
            f"sequential, {ctx.writers} sessions x {ctx.writers} writers, one session x {ctx.writers} writers"
        ),
        "cases": cases,
        "table": table,
        "goals": goals(table, cases),
    }


def goals(table: dict[str, Any], cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 17's Done-when, from this run's figures: the trace service as a writer of many appends
    uses it (AppendMessageStream), with the unary call beside it."""
    pg = table.get("postgres", {})
    stream, unary = pg.get("trace_stream", {}), pg.get("trace", {})
    raw_insert = pg.get("raw_insert", {}).get("sessions")
    one = next(
        (
            c
            for c in cases
            if (c["backend"], c["target"], c["shape"]) == ("postgres", "trace_stream", "one_session")
        ),
        None,
    )
    sessions = stream.get("sessions")
    return {
        "sessions_per_s": sessions,
        "sessions_goal": 5000,
        "sessions_of_raw_insert": sessions / raw_insert if sessions and raw_insert else None,
        "sessions_of_raw_insert_goal": 0.8,
        "one_session_per_s": stream.get("one_session"),
        "one_session_goal": 2000,
        "one_session_p99_ms": one["latency_ms"].get("p99") if one else None,
        "one_session_p99_goal_ms": 50,
        "unary_sessions_per_s": unary.get("sessions"),
        "unary_one_session_per_s": unary.get("one_session"),
    }


# --- the report ----------------------------------------------------------------------------------------

TARGET_NAMES = {
    "trace_stream": "trace service, AppendMessageStream (one appender, two streams, shared by the writers)",
    "trace": "trace service, unary AppendMessages (one message)",
    "grpc_floor": "gRPC floor: health Check, same process",
    "store": "the store in-process, no gRPC",
    "raw_tx": "raw asyncpg, the old transaction",
    "raw_stmt": "raw asyncpg, the new statement",
    "raw_insert": "raw asyncpg, single INSERTs",
}


def markdown(s: dict[str, Any]) -> list[str]:
    """Scenario E's section of latest.md."""
    from bench.report import _skipped, errors, num

    out = [f"## E: trace appends per second ({s.get('what', '')})", "", *_skipped(s)]
    if "cases" not in s:
        return out
    by = {(c["backend"], c["target"], c["shape"]): c for c in s["cases"]}
    head = ["backend", "target", *(f"{shape} /s (p50 / p99 ms)" for shape in SHAPES), "errors", "check"]
    rows = []
    for backend in ("postgres", "sqlite"):
        for target in TARGET_NAMES:
            cells = [by.get((backend, target, shape)) for shape in SHAPES]
            if not any(cells):
                continue
            rows.append(
                [
                    backend,
                    TARGET_NAMES[target],
                    *(
                        "-"
                        if c is None
                        else f"{num(c['appends_per_s'], 0)} ({num(c['latency_ms'].get('p50'), 1)} / "
                        f"{num(c['latency_ms'].get('p99'), 1)})"
                        for c in cells
                    ),
                    errors({k: v for c in cells if c for k, v in c["errors"].items()}),
                    "ok" if all(c is None or c["check"] == "ok" for c in cells) else "FAILED",
                ]
            )
    out += _table(head, rows)
    out += [
        "",
        "CPU per append (ms) of the trace process / this process (load generator, or the store) / "
        "PostgreSQL, and how busy the whole machine was (cores of 2, every process of every user):",
        "",
    ]
    cpu_rows = []
    for c in s["cases"]:
        p = c["cpu"]
        cpu_rows.append(
            [
                c["backend"],
                TARGET_NAMES[c["target"]],
                c["shape"],
                f"{num(p.get('trace_ms_per_append'), 3)} / {num(p.get('bench_ms_per_append'), 3)} / "
                f"{num(p.get('postgres_ms_per_append'), 3)}",
                num(p.get("machine_busy_cores"), 2),
            ]
        )
    out += _table(["backend", "target", "shape", "CPU ms per append", "machine busy cores"], cpu_rows)
    g = s.get("goals") or {}
    out += [
        "",
        "Issue 17's goals on PostgreSQL, through AppendMessageStream: "
        f"sessions x writers: {num(g.get('sessions_per_s'), 0)}/s (goal {g.get('sessions_goal')}), "
        f"{num(g.get('sessions_of_raw_insert'), 2)} of raw single INSERTs "
        f"(goal {g.get('sessions_of_raw_insert_goal')}); "
        f"one session x writers: {num(g.get('one_session_per_s'), 0)}/s (goal {g.get('one_session_goal')}), "
        f"p99 {num(g.get('one_session_p99_ms'), 1)} ms (goal {g.get('one_session_p99_goal_ms')}); "
        f"unary AppendMessages: {num(g.get('unary_sessions_per_s'), 0)}/s and "
        f"{num(g.get('unary_one_session_per_s'), 0)}/s.",
        "",
    ]
    return out


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    from bench.report import table

    return table(head, rows)
