"""Trace service fixtures: one real trace process (TraceService, MessageService, TaskService,
SubagentService, AgentService, AuthService, LeaseService) per backend (SQLite file, PostgreSQL), started
once per run on 127.0.0.1 port 0; tests isolate themselves with unique users. Calls carry the acting
user: `with identity.acting_as(user): await trace_stub.GetTrace(...)`.

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
from agentmesh.libs.errors import from_reason
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer, channel
from agentmesh.services.trace.server import build
from agentmesh.services.trace.store.sql.db import create_engine
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import (
    message_service_pb2_grpc,
    subagent_service_pb2_grpc,
    task_service_pb2_grpc,
    trace_service_pb2_grpc,
)
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.conftest import service_settings

__all__ = [
    "TraceBackend",
    "TraceStubs",
    "agent_stub",
    "auth_stub",
    "empty_database",
    "message_stub",
    "stubs",
    "subagent_stub",
    "task_stub",
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
def message_stub(trace_channel: Any) -> message_service_pb2_grpc.MessageServiceStub:
    return message_service_pb2_grpc.MessageServiceStub(trace_channel)


@pytest.fixture(scope="session")
def task_stub(trace_channel: Any) -> task_service_pb2_grpc.TaskServiceStub:
    return task_service_pb2_grpc.TaskServiceStub(trace_channel)


@pytest.fixture(scope="session")
def subagent_stub(trace_channel: Any) -> subagent_service_pb2_grpc.SubagentServiceStub:
    return subagent_service_pb2_grpc.SubagentServiceStub(trace_channel)


@dataclass(frozen=True)
class TraceStubs:
    """The trace domain's four services, for helpers that use several."""

    traces: trace_service_pb2_grpc.TraceServiceStub
    messages: message_service_pb2_grpc.MessageServiceStub
    tasks: task_service_pb2_grpc.TaskServiceStub
    subagents: subagent_service_pb2_grpc.SubagentServiceStub


@pytest.fixture(scope="session")
def stubs(
    trace_stub: trace_service_pb2_grpc.TraceServiceStub,
    message_stub: message_service_pb2_grpc.MessageServiceStub,
    task_stub: task_service_pb2_grpc.TaskServiceStub,
    subagent_stub: subagent_service_pb2_grpc.SubagentServiceStub,
) -> TraceStubs:
    return TraceStubs(trace_stub, message_stub, task_stub, subagent_stub)


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
    """Clients whose every address is the trace server (only the trace process's services answer)."""
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
    stub: message_service_pb2_grpc.MessageServiceStub,
    owner: str,
    trace_id: str,
    content: str,
    role: Any = tp.MESSAGE_ROLE_USER,
    parent: int | None = None,
    **kw: Any,
) -> tp.Message:
    """One message appended after the head (or `parent`) as `owner`, by an AppendMessageStream of one
    append; a refused append raises the AioRpcError a failed call with its error would."""
    message = tp.Message(trace_id=trace_id, role=role, content=content, **kw)
    request = ms.AppendMessageStreamRequest(append=ms.MessageAppend(message=message))
    if parent is not None:
        request.append.parent_sequence = parent
    with identity.acting_as(owner):
        call = stub.AppendMessageStream(iter([request]))
    (resp,) = [r async for r in call]
    if resp.error_reason:
        err = from_reason(resp.error_reason, resp.error_message)
        raise grpc.aio.AioRpcError(err.grpc_code, grpc.aio.Metadata(), grpc.aio.Metadata(), err.message)
    return resp.message


def recent(stamp: Any, within_s: float = 120.0) -> bool:
    """Whether a Timestamp the service set is now, give or take `within_s` (same machine, same clock)."""
    return abs(time.time() - stamp.ToNanoseconds() / 1e9) < within_s


async def count_rows(engine: AsyncEngine, sql: str, **params: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())
