"""Stream-service fixtures: a real grpc.aio server on a loopback port over a memory or Redis backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest

from agentmesh.v1 import stream_service_pb2_grpc, trace_service_pb2_grpc
from agentmesh.v1 import trace_service_pb2 as ts
from gateway.app import create_app
from libs import embedded_http
from libs.clients import Clients
from libs.config import MeshSettings, StreamSettings
from libs.rpc import ServiceServer, channel
from services.stream.backend import StreamBackend
from services.stream.memory import MemoryBackend
from services.stream.redis_backend import RedisBackend
from services.stream.server import build
from services.trace.server import start_test_server


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
    """A real uvicorn serving the gateway app on a loopback port, over a running stream service and a
    real trace service (for Bearer auth); `client` signs in as alice, `keys` holds alice's and bob's."""

    base_url: str
    client: httpx.AsyncClient
    stream: StreamHarness
    keys: dict[str, str]


@pytest.fixture(scope="session")
async def auth_trace(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A trace service (SQLite) with API keys for alice and bob: (its address, keys by user)."""
    server = await start_test_server("", tmp_path_factory.mktemp("stream-auth"))
    async with channel(server.target) as ch:
        stub = trace_service_pb2_grpc.TraceServiceStub(ch)
        keys = {
            user: (await stub.CreateApiKey(ts.CreateApiKeyRequest(user=user))).api_key
            for user in ("alice", "bob")
        }
    yield server.target, keys
    await server.stop(0)


@pytest.fixture
async def gateway_factory(
    auth_trace: tuple[str, dict[str, str]],
) -> AsyncIterator[Callable[[StreamHarness], Awaitable[Gateway]]]:
    """`await gateway_factory(harness)`: the gateway app over the harness's stream service."""
    trace_address, keys = auth_trace
    running: list[tuple[embedded_http.EmbeddedServer, Clients, httpx.AsyncClient]] = []

    async def make(harness: StreamHarness) -> Gateway:
        settings = harness.settings.model_copy(deep=True)
        settings.addresses.trace = trace_address
        clients = Clients.connect(settings)
        server = await embedded_http.serve(create_app(settings, clients), timeout_graceful_shutdown=1)
        base = f"http://127.0.0.1:{server.port}"
        client = httpx.AsyncClient(
            base_url=base, timeout=10.0, headers={"Authorization": f"Bearer {keys['alice']}"}
        )
        running.append((server, clients, client))
        return Gateway(base, client, harness, keys)

    yield make
    for server, clients, client in running:
        await client.aclose()
        await server.stop()
        await clients.close()
