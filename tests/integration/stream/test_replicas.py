"""Two stream-service processes on one Redis: append through A, subscribe through B, A killed and back."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Unavailable
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import channel, wait_serving
from agentmesh.libs.streams.follower import Follower
from agentmesh.libs.streams.reconnect import Reconnect
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc
from tests.conftest import TEST_SECRET, service_settings
from tests.mesh import Ports

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[3]

Spawn = Callable[[int], Awaitable[asyncio.subprocess.Process]]


@pytest.fixture
def prefix(unique: str) -> str:
    """The Redis namespace of this test's replicas."""
    return f"test:{unique}:"


@pytest.fixture
def ports() -> Iterator[Ports]:
    ports = Ports()
    yield ports
    ports.release()


@pytest.fixture
async def spawn(redis_url: str, prefix: str, tmp_path: Path) -> AsyncIterator[Spawn]:
    """`await spawn(port)`: `agentmesh serve stream` on that (reserved) port with the Redis backend and
    the test mesh secret, once SERVING."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(port: int) -> asyncio.subprocess.Process:
        env = {
            **os.environ,
            "AGENTMESH_ADDRESSES__STREAM": f"127.0.0.1:{port}",
            "AGENTMESH_STREAM__BACKEND": "redis",
            "AGENTMESH_STREAM__REDIS_PREFIX": prefix,
            "AGENTMESH_REDIS_URL": redis_url,
            "AGENTMESH_MESH_SECRET": TEST_SECRET,
            "AGENTMESH_DATA_DIR": str(tmp_path),
            "AGENTMESH_LOG_LEVEL": "WARNING",
            "PYTHONFAULTHANDLER": "1",  # a crash in native code prints its Python stack
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentmesh.cli", "serve", "stream", cwd=ROOT, env=env
        )
        procs.append(proc)
        try:
            await wait_serving(f"127.0.0.1:{port}", 20)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc} (the process: exit code {proc.returncode})") from exc
        return proc

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 10)
    assert [p.returncode for p in procs if p.returncode not in (0, -signal.SIGKILL)] == []  # SIGTERM drains
    client = aioredis.Redis.from_url(redis_url)
    keys = [k async for k in client.scan_iter(f"{prefix}*")]
    if keys:
        await client.delete(*keys)
    await client.aclose()


async def test_two_replicas_survive_a_killed_writer(
    spawn: Spawn, ports: Ports, signer: Signer, unique: str
) -> None:
    port_a, port_b = ports.take(), ports.take()
    proc_a, _ = await asyncio.gather(spawn(port_a), spawn(port_b))
    ch_a = channel(f"127.0.0.1:{port_a}", signer, unary_timeout_s=5.0, stream_timeout_s=60.0)
    ch_b = channel(f"127.0.0.1:{port_b}", signer, unary_timeout_s=5.0, stream_timeout_s=60.0)
    a, b = stream_service_pb2_grpc.StreamServiceStub(ch_a), stream_service_pb2_grpc.StreamServiceStub(ch_b)
    key = f"a2a:{unique}"
    got: list[ev.Event] = []
    seen = {n: asyncio.Event() for n in (1, 40)}

    async def append(stub: stream_service_pb2_grpc.StreamServiceStub, start: int, n: int) -> list[str]:
        batch = [events.reasoning_delta(str(i)) for i in range(start, start + n)]
        resp = await stub.AppendEvents(pb.AppendEventsRequest(key=key, events=batch), wait_for_ready=True)
        return list(resp.offsets)

    follows = Follower(lambda: b, signer, 30.0, Reconnect(ch_b.channel_ready, 5.0))

    async def subscriber() -> None:
        with identity.acting_as("alice"):  # the owner follows through the other replica
            follow = follows.follow(key)
        async for event in follow:
            got.append(event)
            if len(got) in seen:
                seen[len(got)].set()

    try:
        with identity.acting_as("alice"):
            await a.CreateStream(pb.CreateStreamRequest(key=key))
        offsets = await append(a, 0, 1)
        task = asyncio.create_task(subscriber())
        await asyncio.wait_for(seen[1].wait(), 10)
        for start in range(1, 40, 13):
            offsets += await append(a, start, min(13, 40 - start))
        await asyncio.wait_for(seen[40].wait(), 10)

        proc_a.kill()  # SIGKILL mid-stream: the buffer is open, B's subscriber is following live
        assert await asyncio.wait_for(proc_a.wait(), 10) == -signal.SIGKILL
        await spawn(port_a)
        for start in range(40, 80, 10):
            offsets += await append(a, start, 10)
        close = await a.CloseStream(pb.CloseStreamRequest(key=key, done=ev.StreamDone()), wait_for_ready=True)
        offsets.append(close.offset)
        await asyncio.wait_for(task, 10)

        assert [e.offset for e in got] == offsets  # everything, once, in order
        assert [e.reasoning_delta.reasoning_delta for e in got[:-1]] == [str(i) for i in range(80)]
        assert events.kind(got[-1]) == "done"
        with identity.acting_as("alice"):
            info = await b.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
        assert (info.exists, info.closed, info.length) == (True, True, 81)
        with identity.acting_as("bob"):  # ownership is shared state too
            assert not (await b.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists
        with pytest.raises(grpc.aio.AioRpcError) as busy:  # B sees the state A wrote
            await b.AppendEvents(pb.AppendEventsRequest(key=key, events=[events.text_delta("x")]))
        assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        await follows.aclose()
        await ch_a.close()
        await ch_b.close()


async def test_a_writer_and_a_reader_go_on_across_a_restart_of_their_stream_service(
    spawn: Spawn, ports: Ports, signer: Signer, unique: str
) -> None:
    """The runtime's EventSink writing and a reader following one buffer when their only stream service
    (on Redis) is SIGKILLed and started again: both go on from where they were once it answers, and the
    reader gets every event once, in order: nothing lost, nothing repeated (the events written while it
    was down included)."""
    port = ports.take()
    proc = await spawn(port)
    settings = service_settings()
    settings.addresses.stream = f"127.0.0.1:{port}"
    clients = Clients(settings, signer)
    key = f"trace:{unique}"
    try:
        with identity.acting_as("alice"):
            await clients.stream.CreateStream(pb.CreateStreamRequest(key=key))
            sink = EventSink(clients, key)
            follow = clients.follows.follow(key)
        texts = [str(i) for i in range(60)]
        for text in texts[:10]:
            await sink.store(events.reasoning_delta(text))
        got: list[ev.Event] = []
        reading = asyncio.get_running_loop().create_future()

        async def read() -> None:
            async for event in follow:
                got.append(event)
                if len(got) == 10:
                    reading.set_result(None)

        reader = asyncio.create_task(read())
        await asyncio.wait_for(reading, 10)
        proc.kill()
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
        for text in texts[10:30]:
            sink.emit(events.reasoning_delta(text))  # while the service is down
        await spawn(port)
        for text in texts[30:]:
            sink.emit(events.reasoning_delta(text))
        await asyncio.wait_for(sink.aclose(), 20)
        assert sink.failure is None
        with identity.acting_as("alice"):
            await clients.stream.CloseStream(pb.CloseStreamRequest(key=key, done=ev.StreamDone()))
        await asyncio.wait_for(reader, 20)
        deltas = [e.reasoning_delta.reasoning_delta for e in got if e.HasField("reasoning_delta")]
        assert deltas[:10] == texts[:10]  # each stored alone (store() waits for it)
        # the rest, merged by the sink as it queued: every delta once, in order
        assert "".join(deltas[10:]) == "".join(texts[10:]), "every event once, in order"
        assert got[-1].HasField("done")
        assert follow.resumed
    finally:
        await clients.close()


async def test_a_writer_whose_stream_service_stays_away_fails_after_the_reconnect_budget(
    spawn: Spawn, ports: Ports, signer: Signer, unique: str
) -> None:
    """The same sink when its stream service does not come back: it fails `unavailable` once the
    reconnect budget (AGENTMESH_STREAM__RECONNECT_S) is spent (its run then ends with that terminal
    event, see tests/e2e/cli/test_faults.py), not at the call's deadline (an hour)."""
    port = ports.take()
    proc = await spawn(port)
    settings = service_settings()
    settings.addresses.stream = f"127.0.0.1:{port}"
    settings.stream.reconnect_s = 1.0
    clients = Clients(settings, signer)
    key = f"trace:{unique}"
    try:
        with identity.acting_as("alice"):
            await clients.stream.CreateStream(pb.CreateStreamRequest(key=key))
            sink = EventSink(clients, key)
        stored = [await sink.store(events.reasoning_delta(str(i))) for i in range(3)]
        proc.kill()
        assert await asyncio.wait_for(proc.wait(), 10) == -signal.SIGKILL
        sink.emit(events.reasoning_delta("lost"))
        with pytest.raises(Unavailable, match="did not answer for 1 s"):
            await asyncio.wait_for(sink.flush(), 10)  # the budget, long before the call's deadline
        assert isinstance(sink.failure, Unavailable)
        with pytest.raises(Unavailable):
            await sink.store(events.reasoning_delta("after"))  # a failed sink refuses at once
        assert len(stored) == 3 and all(stored)
    finally:
        await clients.close()
