"""Scenario E's cases: each target and shape appended to by its writers at once, then checked."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bench.scenarios.appends.measure import CpuMeter, check_pg, check_sqlite
from bench.scenarios.appends.targets import (
    Append,
    HealthFloor,
    InProcessStore,
    RawPg,
    TraceProcess,
    TraceStream,
    fresh_pg_database,
)
from bench.stats import dist

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
    return dist(values, 1000.0)


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
