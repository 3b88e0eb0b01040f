"""Stream-service fixtures: a real grpc.aio server on a loopback port over a memory or Redis backend.

The gateway tests (tests/integration/gateway/test_sse.py) import `gateway_factory` and the fixtures it
needs from here.
Buffers belong to the user who creates them: `with identity.acting_as("alice"): await create(...)`;
calls outside `acting_as` carry the mesh's own principal, which reads any buffer but creates none.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import redis.asyncio as aioredis

from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.app import create_app
from agentmesh.gateway.server import http_limits
from agentmesh.libs import embedded_http, events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings, StreamSettings
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer, channel
from agentmesh.libs.streams.follower import Follow, Follower
from agentmesh.libs.streams.reconnect import Reconnect
from agentmesh.services.stream.backend import StreamBackend
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.services.stream.redis_backend import RedisBackend
from agentmesh.services.stream.server import build
from agentmesh.services.trace import server as trace_server
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc
from tests.conftest import service_settings

USERS = ("alice", "bob")


class ManualClock:
    """A monotonic clock that moves only when told: TTL tests move time instead of sleeping."""

    def __init__(self) -> None:
        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class StreamHarness:
    """One running stream service: its backend, server and a client stub (signing the acting user)."""

    backend: StreamBackend
    server: ServiceServer
    channel: grpc.aio.Channel
    stub: stream_service_pb2_grpc.StreamServiceStub
    settings: MeshSettings
    clock: ManualClock | None  # the memory backend's expiry clock (None on Redis: real time)
    follows: Follower  # follows on FollowStreams calls, as the readers of the mesh follow

    @property
    def redis(self) -> aioredis.Redis | None:
        return self.backend.client if isinstance(self.backend, RedisBackend) else None

    def redis_keys(self, key: str) -> list[str]:
        """`<prefix>meta:<key>`, `<prefix>stream:<key>` of a buffer on Redis."""
        assert isinstance(self.backend, RedisBackend)
        return [f"{self.backend.prefix}meta:{key}", f"{self.backend.prefix}stream:{key}"]

    async def stop(self) -> None:
        await self.follows.aclose()
        await self.channel.close()
        await self.server.stop(1.0)
        await self.backend.aclose()


StreamFactory = Callable[..., Awaitable[StreamHarness]]


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def backend_kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def stream_factory(
    backend_kind: str, request: pytest.FixtureRequest, unique: str, signer: Signer
) -> AsyncIterator[StreamFactory]:
    """`await stream_factory(ttl_s=..., max_events=...)`: a started stream service with those settings
    (the memory backend on a ManualClock)."""
    redis_url = request.getfixturevalue("redis_url") if backend_kind == "redis" else ""
    started: list[StreamHarness] = []

    async def make(via: str = "", **stream: Any) -> StreamHarness:
        """`via`: the Redis URL the backend reaches Redis by (a RedisRelay's), instead of Redis's own."""
        settings = service_settings(
            stream=StreamSettings(backend=backend_kind, **stream), shutdown_grace_s=2.0
        )
        backend: StreamBackend
        clock = None
        if backend_kind == "redis":
            backend = RedisBackend(via or redis_url, settings.stream, prefix=f"test:{unique}:{len(started)}:")
        else:
            clock = ManualClock()
            backend = MemoryBackend(settings.stream, clock=clock)
        server = await build(settings, "127.0.0.1:0", backend, signer)
        try:
            await server.start()
        except BaseException:
            await backend.aclose()
            raise
        settings.addresses.stream = server.target
        ch = channel(server.target, signer, unary_timeout_s=5.0, stream_timeout_s=30.0)
        stub = stream_service_pb2_grpc.StreamServiceStub(ch)
        reconnect = Reconnect(ch.channel_ready, 1.0)  # a service that went away fails its follows soon
        follows = Follower(lambda: stub, signer, settings.stream_rpc_timeout_s / 2, reconnect)
        harness = StreamHarness(backend, server, ch, stub, settings, clock, follows)
        started.append(harness)
        return harness

    yield make
    for harness in started:
        await harness.stop()
    if backend_kind == "redis":
        client = aioredis.Redis.from_url(redis_url)
        keys = [k async for k in client.scan_iter(f"test:{unique}:*")]
        if keys:
            await client.delete(*keys)
        await client.aclose()


class RedisRelay:
    """A loopback TCP relay in front of Redis: a stream service whose backend reaches Redis through it
    loses Redis when `cut()` drops every connection and refuses new ones (Redis itself stays up for
    everything else)."""

    def __init__(self, redis_url: str) -> None:
        self.target = urllib.parse.urlsplit(redis_url)
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> RedisRelay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = self.target._replace(netloc=f"127.0.0.1:{port}").geturl()
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.target.hostname, self.target.port or 6379)
        self._writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.transport.abort()


@pytest.fixture
async def redis_relay(redis_url: str) -> AsyncIterator[RedisRelay]:
    relay = await RedisRelay(redis_url).start()
    yield relay
    relay.cut()


@pytest.fixture
async def stream(stream_factory: StreamFactory) -> StreamHarness:
    """A stream service with default settings."""
    return await stream_factory()


# ---- calls, as a user or as the mesh -------------------------------------------------------------------


def deltas(*texts: str) -> list[ev.Event]:
    return [events.text_delta(t) for t in texts]


async def create(h: StreamHarness, key: str, owner: str = "alice", **metadata: str) -> None:
    """CreateStream as `owner` (the buffer's owner is the caller)."""
    with identity.acting_as(owner):
        await h.stub.CreateStream(pb.CreateStreamRequest(key=key, metadata=metadata or {"agent": "demo"}))


async def append(h: StreamHarness, key: str, batch: list[ev.Event]) -> list[str]:
    """AppendEvents as the mesh (the runtime writes the user's buffer)."""
    return list((await h.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=batch))).offsets)


async def close(h: StreamHarness, key: str) -> pb.CloseStreamResponse:
    return await h.stub.CloseStream(pb.CloseStreamRequest(key=key, done=ev.StreamDone()))


async def info(h: StreamHarness, key: str, reader: str = "") -> pb.GetStreamInfoResponse:
    """GetStreamInfo as `reader` ("" : the mesh, which sees every buffer)."""
    with identity.acting_as(reader):
        return await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))


def follow(h: StreamHarness, key: str, reader: str = "", **kw: Any) -> Follow:
    """A follow of `key` (on the harness's FollowStreams call) as `reader` ("" : the mesh)."""
    with identity.acting_as(reader):
        return h.follows.follow(key, **kw)


async def collect(h: StreamHarness, key: str, reader: str = "", **kw: Any) -> list[ev.Event]:
    """Every event of a follow as `reader` ("" : the mesh), up to its end; a follow that fails raises
    its MeshError."""
    return [e async for e in follow(h, key, reader, **kw)]


def as_int(offset: str) -> tuple[int, ...]:
    return tuple(int(part) for part in offset.split("-"))


# ---- the gateway over a stream service ------------------------------------------------------------------


@dataclass
class Gateway:
    """A real uvicorn serving the gateway app on a loopback port, over a running stream service and a
    real trace service (for Bearer auth); `client` signs in as alice, `keys` holds alice's and bob's."""

    base_url: str
    client: httpx.AsyncClient
    stream: StreamHarness
    keys: dict[str, str]


@pytest.fixture(scope="session")
async def auth_trace(
    tmp_path_factory: pytest.TempPathFactory, signer: Signer
) -> AsyncIterator[tuple[str, dict[str, str]]]:
    """A trace service (SQLite) with API keys for alice and bob: (its address, keys by user)."""
    settings = service_settings(data_dir=tmp_path_factory.mktemp("stream-auth"))
    server = await trace_server.build(settings, "127.0.0.1:0", signer)
    try:
        async with channel(server.target, signer) as ch:
            stub = auth_service_pb2_grpc.AuthServiceStub(ch)
            keys = {  # the mesh's own principal creates keys (outside acting_as)
                user: (await stub.CreateApiKey(au.CreateApiKeyRequest(user=user))).api_key for user in USERS
            }
        yield server.target, keys
    finally:
        await server.stop(0)


GatewayFactory = Callable[[StreamHarness], Awaitable[Gateway]]


@pytest.fixture
async def gateway_factory(
    auth_trace: tuple[str, dict[str, str]], signer: Signer
) -> AsyncIterator[GatewayFactory]:
    """`await gateway_factory(harness)`: the gateway app over the harness's stream service."""
    trace_address, keys = auth_trace
    running: list[tuple[embedded_http.EmbeddedServer, Clients, httpx.AsyncClient]] = []

    async def make(harness: StreamHarness) -> Gateway:
        settings = harness.settings.model_copy(deep=True)
        settings.addresses.trace = trace_address
        clients = Clients(settings, signer)
        server = await embedded_http.serve(
            create_app(settings, clients), timeout_graceful_shutdown=1, **http_limits()
        )
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
