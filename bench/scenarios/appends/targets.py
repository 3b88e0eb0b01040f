"""What scenario E appends through: the trace service as its own process (unary or streamed appends,
and the gRPC floor on it), its store in this process, and asyncpg straight on the same tables."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import asyncpg
import psutil

from agentmesh.libs.ids import new_message_id

Append = Callable[[int, str, str], Awaitable[Any]]  # (writer, owner, session id) -> acknowledged


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
                    "mid": new_message_id(),
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
