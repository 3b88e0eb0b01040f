"""Trace service fixtures: one real trace process (TraceService, AgentService, AuthService) per backend
(SQLite file, PostgreSQL), started once per run on 127.0.0.1 port 0; tests isolate themselves with
unique users. Calls carry the acting user: `with identity.acting_as(user): await stub.GetTrace(...)`.

Reuse from another suite: `from tests.integration.trace.conftest import *` (every fixture below, with
the ones they need), or call `services.trace.server.build(settings, "127.0.0.1:0")` directly."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import asyncpg
import grpc
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer, channel
from agentmesh.services.trace.server import build
from agentmesh.services.trace.store.sql.db import create_engine
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from agentmesh.trace.v1 import trace_service_pb2_grpc
from tests.conftest import service_settings

__all__ = [
    "TraceBackend",
    "agent_stub",
    "auth_stub",
    "empty_database",
    "trace_backend",
    "trace_channel",
    "trace_clients",
    "trace_engine",
    "trace_pg_url",
    "trace_server",
    "trace_stub",
]


@dataclass
class TraceBackend:
    """Which database a parametrised trace test runs on."""

    name: str  # "sqlite" | "postgres"
    database_url: str  # "" for the SQLite file in data_dir
    data_dir: Path

    @property
    def settings(self) -> MeshSettings:
        return service_settings(database_url=self.database_url, data_dir=self.data_dir)


@contextlib.asynccontextmanager
async def new_pg_database(pg_url: str, prefix: str) -> AsyncIterator[str]:
    """A new empty PostgreSQL database next to the run's (`pg_url`), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield urlparse(pg_url)._replace(path=f"/{name}").geturl()
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


@pytest.fixture(scope="session")
async def trace_pg_url(pg_url: str) -> AsyncIterator[str]:
    """The trace suite's own PostgreSQL database: the mesh suites share `pg_url` and import their own
    catalogs into it, which would change the built-in agents under these tests."""
    async with new_pg_database(pg_url, "trace_suite") as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def trace_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TraceBackend:
    data_dir = tmp_path_factory.mktemp(f"trace-{request.param}")
    if request.param == "sqlite":
        return TraceBackend("sqlite", "", data_dir)
    return TraceBackend("postgres", request.getfixturevalue("trace_pg_url"), data_dir)


@pytest.fixture(scope="session")
async def trace_server(trace_backend: TraceBackend) -> AsyncIterator[ServiceServer]:
    """The started trace service on port 0 (migrated, the demo catalog's agents imported)."""
    server = await build(trace_backend.settings, "127.0.0.1:0")
    yield server
    await server.stop(0)


@pytest.fixture(scope="session")
async def trace_channel(trace_server: ServiceServer, signer: Signer) -> AsyncIterator[Any]:
    """A channel that signs the acting user of each call (`with identity.acting_as(user): ...`)."""
    ch = channel(trace_server.target, signer, unary_timeout_s=30.0)
    yield ch
    await ch.close()


@pytest.fixture(scope="session")
def trace_stub(trace_channel: Any) -> trace_service_pb2_grpc.TraceServiceStub:
    return trace_service_pb2_grpc.TraceServiceStub(trace_channel)


@pytest.fixture(scope="session")
def agent_stub(trace_channel: Any) -> agent_service_pb2_grpc.AgentServiceStub:
    return agent_service_pb2_grpc.AgentServiceStub(trace_channel)


@pytest.fixture(scope="session")
def auth_stub(trace_channel: Any) -> auth_service_pb2_grpc.AuthServiceStub:
    return auth_service_pb2_grpc.AuthServiceStub(trace_channel)


@pytest.fixture(scope="session")
async def trace_engine(
    trace_backend: TraceBackend, trace_server: ServiceServer
) -> AsyncIterator[AsyncEngine]:
    """A separate engine on the service's database, for counting rows with SQL."""
    engine = create_engine(trace_backend.settings.sqlalchemy_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
async def trace_clients(
    trace_backend: TraceBackend, trace_server: ServiceServer, signer: Signer
) -> AsyncIterator[Clients]:
    """Clients whose every address is the trace server (only trace, agents and auth answer)."""
    settings = trace_backend.settings
    a = settings.addresses
    a.trace = a.stream = a.orchestrator = a.agent_runtime = trace_server.target
    clients = Clients(settings, signer)
    yield clients
    await clients.close()


@pytest.fixture(params=["sqlite", "postgres"])
async def empty_database(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[str]:
    """The URL of a brand-new empty database of the test's own (an SQLite file, a PostgreSQL database),
    for `create_engine` or `database_url`; dropped afterwards."""
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}"
        return
    async with new_pg_database(request.getfixturevalue("pg_url"), "trace_empty") as url:
        yield url


# ---- helpers used by the trace tests -----------------------------------------------------------------


async def code_of(call: Awaitable[Any]) -> grpc.StatusCode:
    """The status code a failing RPC ends with (fails the test when it succeeds)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    raise AssertionError("the RPC succeeded")


async def error_of(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc
    raise AssertionError("the RPC succeeded")


async def new_trace(stub: trace_service_pb2_grpc.TraceServiceStub, owner: str, **kw: Any) -> tp.Trace:
    """A trace of `owner` (kind chat unless given)."""
    kw.setdefault("agent", "general")
    trace_id = kw.pop("trace_id", "")
    with identity.acting_as(owner):
        return (await stub.CreateTrace(ts.CreateTraceRequest(trace=tp.Trace(**kw), trace_id=trace_id))).trace


async def append(
    stub: trace_service_pb2_grpc.TraceServiceStub,
    owner: str,
    trace_id: str,
    content: str,
    role: Any = tp.MESSAGE_ROLE_USER,
    parent: int | None = None,
    **kw: Any,
) -> tp.Message:
    message = tp.Message(trace_id=trace_id, role=role, content=content, **kw)
    request = ts.AppendMessageRequest(message=message)
    if parent is not None:
        request.parent_sequence = parent
    with identity.acting_as(owner):
        return (await stub.AppendMessage(request)).message


def recent(stamp: Any, within_s: float = 120.0) -> bool:
    """Whether a Timestamp the service set is now, give or take `within_s` (same machine, same clock)."""
    return abs(time.time() - stamp.ToNanoseconds() / 1e9) < within_s


async def count_rows(engine: AsyncEngine, sql: str, **params: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())
