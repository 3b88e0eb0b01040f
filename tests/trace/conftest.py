"""Trace service fixtures: one real TraceService per backend (SQLite file, PostgreSQL), started once per
run on 127.0.0.1 port 0; tests isolate themselves with unique owners.

Reuse from another suite: `from tests.trace.conftest import *` or call
`services.trace.server.start_test_server(database_url, data_dir)` directly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from agentmesh.v1 import (
    agent_runtime_service_pb2_grpc,
    orchestrator_service_pb2_grpc,
    stream_service_pb2_grpc,
    trace_pb2,
    trace_service_pb2_grpc,
)
from agentmesh.v1 import trace_service_pb2 as ts
from gateway.app import create_app
from libs.clients import Clients
from libs.config import MeshSettings
from libs.rpc import ServiceServer, channel
from services.trace.db import create_engine
from services.trace.server import start_test_server

__all__ = [
    "TraceBackend",
    "gateway_http",
    "trace_backend",
    "trace_clients",
    "trace_engine",
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
        return MeshSettings(database_url=self.database_url, data_dir=self.data_dir)


@pytest.fixture(scope="session", params=["sqlite", "postgres"])
def trace_backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> TraceBackend:
    data_dir = tmp_path_factory.mktemp(f"trace-{request.param}")
    if request.param == "sqlite":
        return TraceBackend("sqlite", "", data_dir)
    return TraceBackend("postgres", request.getfixturevalue("pg_url"), data_dir)


@pytest.fixture(scope="session")
async def trace_server(trace_backend: TraceBackend) -> AsyncIterator[ServiceServer]:
    """The started trace service (migrated, demo catalog agents synced)."""
    server = await start_test_server(trace_backend.database_url, trace_backend.data_dir)
    yield server
    await server.stop(0)


@pytest.fixture(scope="session")
async def trace_stub(trace_server: ServiceServer) -> AsyncIterator[trace_service_pb2_grpc.TraceServiceStub]:
    ch = channel(trace_server.target, unary_timeout_s=30.0)
    yield trace_service_pb2_grpc.TraceServiceStub(ch)
    await ch.close()


@pytest.fixture(scope="session")
async def trace_engine(
    trace_backend: TraceBackend, trace_server: ServiceServer
) -> AsyncIterator[AsyncEngine]:
    """A separate engine on the service's database, for counting rows with SQL."""
    engine = create_engine(trace_backend.settings.sqlalchemy_url)
    yield engine
    await engine.dispose()


@pytest.fixture(scope="session")
async def trace_clients(trace_server: ServiceServer) -> AsyncIterator[Clients]:
    """Clients whose every stub points at the trace server (only `trace` is used)."""
    ch = channel(trace_server.target, unary_timeout_s=30.0)
    yield Clients(
        trace=trace_service_pb2_grpc.TraceServiceStub(ch),
        stream=stream_service_pb2_grpc.StreamServiceStub(ch),
        orchestrator=orchestrator_service_pb2_grpc.OrchestratorServiceStub(ch),
        runtime=agent_runtime_service_pb2_grpc.AgentRuntimeServiceStub(ch),
        channels=[ch],
    )
    await ch.close()


@pytest.fixture(scope="session")
async def gateway_http(
    trace_backend: TraceBackend, trace_clients: Clients
) -> AsyncIterator[httpx.AsyncClient]:
    """The real gateway app (no auth header set) over httpx.ASGITransport."""
    app = create_app(trace_backend.settings, trace_clients)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client


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


async def new_session(
    stub: trace_service_pb2_grpc.TraceServiceStub, owner: str, **kw: Any
) -> trace_pb2.Session:
    kw.setdefault("agent", "general")
    return (await stub.CreateSession(ts.CreateSessionRequest(owner=owner, **kw))).session


async def append(
    stub: trace_service_pb2_grpc.TraceServiceStub,
    owner: str,
    session_id: str,
    content: str,
    role: Any = trace_pb2.MESSAGE_ROLE_USER,
    parent: int | None = None,
    **kw: Any,
) -> trace_pb2.Message:
    message = trace_pb2.Message(session_id=session_id, role=role, content=content, **kw)
    request = ts.AppendMessageRequest(owner=owner, message=message)
    if parent is not None:
        request.parent_sequence = parent
    return (await stub.AppendMessage(request)).message


async def count_rows(engine: AsyncEngine, sql: str, **params: Any) -> int:
    async with engine.connect() as conn:
        return int((await conn.execute(text(sql), params)).scalar_one())
