"""Stream-service fixtures: a real grpc.aio server on a loopback port over a memory or Redis backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from fastapi import Request

import gateway.deps
from agentmesh.v1 import stream_service_pb2_grpc
from gateway.app import create_app
from libs import embedded_http
from libs.clients import Clients
from libs.config import MeshSettings, StreamSettings
from libs.rpc import ServiceServer, channel
from services.stream.backend import StreamBackend
from services.stream.memory import MemoryBackend
from services.stream.redis_backend import RedisBackend
from services.stream.server import build


@dataclass
class StreamHarness:
    """One running stream service: its backend, server and a client stub."""

    backend: StreamBackend
    server: ServiceServer
    channel: grpc.aio.Channel
    stub: stream_service_pb2_grpc.StreamServiceStub
    settings: MeshSettings

    async def stop(self) -> None:
        await self.channel.close()
        await self.server.stop(1.0)
        await self.backend.aclose()


StreamFactory = Callable[..., Awaitable[StreamHarness]]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def stream_factory(
    backend_kind: str, request: pytest.FixtureRequest, unique: str
) -> AsyncIterator[StreamFactory]:
    """`await stream_factory(ttl_s=..., max_events=...)`: a started stream service with those settings."""
    redis_url = request.getfixturevalue("redis_url") if backend_kind == "redis" else ""
    started: list[StreamHarness] = []

    async def make(**stream: Any) -> StreamHarness:
        settings = MeshSettings(stream=StreamSettings(backend=backend_kind, **stream), shutdown_grace_s=2.0)
        backend: StreamBackend
        if backend_kind == "redis":
            backend = RedisBackend(redis_url, settings.stream, prefix=f"test:{unique}:{len(started)}:")
        else:
            backend = MemoryBackend(settings.stream)
        server = await (await build(settings, "127.0.0.1:0", backend)).start()
        settings.addresses.stream = server.target
        ch = channel(server.target, 5.0, 30.0)
        harness = StreamHarness(backend, server, ch, stream_service_pb2_grpc.StreamServiceStub(ch), settings)
        started.append(harness)
        return harness

    yield make
    for harness in started:
        await harness.stop()
    if backend_kind == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(f"test:{unique}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture
async def stream(stream_factory: StreamFactory) -> StreamHarness:
    """A stream service with default settings."""
    return await stream_factory()


@dataclass
class Gateway:
    """A real uvicorn serving the gateway app on a loopback port, over a running stream service."""

    base_url: str
    client: httpx.AsyncClient
    stream: StreamHarness


@pytest.fixture
async def gateway_factory() -> AsyncIterator[Callable[[StreamHarness], Awaitable[Gateway]]]:
    """`await gateway_factory(harness)`: the gateway app (auth overridden: user = X-Test-User or alice)."""
    running: list[tuple[embedded_http.EmbeddedServer, Clients, httpx.AsyncClient]] = []

    async def make(harness: StreamHarness) -> Gateway:
        clients = Clients.connect(harness.settings)
        app = create_app(harness.settings, clients)
        app.dependency_overrides[gateway.deps.current_user] = _test_user
        server = await embedded_http.serve(app, timeout_graceful_shutdown=1)
        base = f"http://127.0.0.1:{server.port}"
        client = httpx.AsyncClient(base_url=base, timeout=10.0)
        running.append((server, clients, client))
        return Gateway(base, client, harness)

    yield make
    for server, clients, client in running:
        await client.aclose()
        await server.stop()
        await clients.close()


def _test_user(request: Request) -> str:
    return request.headers.get("x-test-user", "alice")
