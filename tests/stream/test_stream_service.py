"""StreamService over real gRPC, parametrised over the memory and Redis backends."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import stream_service_pb2 as pb
from libs import events
from services.stream.backend import BATCH, coalesce, validate_key
from services.stream.memory import MemoryBackend
from services.stream.redis_backend import RedisBackend
from tests.mesh import wait_until
from tests.stream.conftest import StreamFactory, StreamHarness


def deltas(*texts: str) -> list[ev.Event]:
    return [events.text_delta(t) for t in texts]


async def create(h: StreamHarness, key: str, owner: str = "alice") -> None:
    await h.stub.CreateStream(pb.CreateStreamRequest(key=key, owner=owner, metadata={"agent": "demo"}))


async def append(h: StreamHarness, key: str, batch: list[ev.Event]) -> list[str]:
    return list((await h.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=batch))).offsets)


async def close(h: StreamHarness, key: str) -> pb.CloseStreamResponse:
    return await h.stub.CloseStream(pb.CloseStreamRequest(key=key, done=ev.Done()))


def as_int(offset: str) -> tuple[int, ...]:
    return tuple(int(part) for part in offset.split("-"))


async def collect(h: StreamHarness, key: str, **kw: object) -> list[ev.Event]:
    call = h.stub.SubscribeStream(pb.SubscribeStreamRequest(key=key, **kw))  # type: ignore[arg-type]
    return [r.event async for r in call]


def test_validate_key() -> None:
    assert validate_key("a2a:t-1") == "a2a:t-1"
    for bad in ("foo:1", "session", "session:", "subagent:" + "x" * 201, ""):
        with pytest.raises(Exception, match="invalid stream key"):
            validate_key(bad)


def test_coalesce_merges_only_consecutive_text_deltas() -> None:
    batch = [
        *deltas("a", "b"),
        events.reasoning_delta("r"),
        events.reasoning_delta("s"),
        *deltas("c", "d", "e"),
    ]
    for i, e in enumerate(batch):
        e.offset = f"{i:020d}"
    out = coalesce(batch)
    assert [events.kind(e) for e in out] == ["text_delta", "reasoning_delta", "reasoning_delta", "text_delta"]
    assert (out[0].text_delta.text_delta, out[0].offset) == ("ab", batch[1].offset)
    assert (out[3].text_delta.text_delta, out[3].offset) == ("cde", batch[6].offset)


async def test_lifecycle_offsets_and_errors(stream: StreamHarness, unique: str) -> None:
    key = f"session:{unique}"
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await append(stream, key, deltas("x"))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    await create(stream, key)
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await create(stream, key)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"a run is already streaming to {key}" in (busy.value.details() or "")

    first = await append(stream, key, deltas("a", "b", "c"))
    assert len(first) == 3 and [as_int(o) for o in first] == sorted({as_int(o) for o in first})
    info = await stream.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (info.exists, info.closed, info.length, info.owner) == (True, False, 3, "alice")
    assert info.last_offset == first[-1] and dict(info.metadata) == {"agent": "demo"}

    closed = await close(stream, key)
    assert closed.closed and as_int(closed.offset) > as_int(first[-1])
    again = await stream.stub.CloseStream(
        pb.CloseStreamRequest(key=key, error=ev.Error(code="x", message="y"))
    )
    assert (again.closed, again.offset) == (False, closed.offset)
    events_ = await collect(stream, key)
    assert [events.kind(e) for e in events_][-1] == "done"  # the second close changed nothing

    with pytest.raises(grpc.aio.AioRpcError) as after_close:
        await append(stream, key, deltas("late"))
    assert after_close.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    await create(stream, key, owner="bob")  # a closed buffer is replaced
    second = await append(stream, key, deltas("new"))
    assert as_int(second[0]) > as_int(closed.offset)  # offsets never reused
    replay = await stream.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (replay.length, replay.owner, replay.closed) == (1, "bob", False)

    unknown = await stream.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=f"a2a:{unique}-none"))
    assert not unknown.exists
    hidden = await stream.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key, reader="mallory"))
    assert not hidden.exists


@pytest.mark.parametrize("key", ["foo:1", "session:", "subagent:" + "x" * 201])
async def test_invalid_key(stream: StreamHarness, key: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await create(stream, key)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_close_requires_outcome(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"session:{unique}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.stub.CloseStream(pb.CloseStreamRequest(key=f"session:{unique}"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_replay_then_live(stream: StreamHarness, unique: str) -> None:
    key = f"a2a:{unique}"
    await create(stream, key)
    early = await append(stream, key, [*deltas("0", "1", "2"), events.reasoning_delta("think")])
    got: list[ev.Event] = []
    caught_up = asyncio.Event()

    async def subscriber() -> None:
        async for response in stream.stub.SubscribeStream(pb.SubscribeStreamRequest(key=key, reader="alice")):
            got.append(response.event)
            if len(got) >= 2:  # "012" coalesced + the reasoning delta
                caught_up.set()

    task = asyncio.create_task(subscriber())
    await asyncio.wait_for(caught_up.wait(), 5)
    assert got[0].text_delta.text_delta == "012" and got[0].offset == early[2]  # a lagging replay coalesces
    live: list[str] = []
    for i in range(3, 8):
        live += await append(stream, key, [events.text_delta(str(i))])
    live.append((await close(stream, key)).offset)
    await asyncio.wait_for(task, 5)

    text = "".join(e.text_delta.text_delta for e in got if events.kind(e) == "text_delta")
    assert text == "01234567"
    offsets = [as_int(e.offset) for e in got]
    assert offsets == sorted(set(offsets))  # in order, no duplicates
    assert got[-1].offset == live[-1] and events.kind(got[-1]) == "done"
    # a subscriber joining after the fact replays the same, and from an offset exactly what follows it
    tail = await collect(stream, key, from_offset=early[3])
    assert "".join(e.text_delta.text_delta for e in tail if events.kind(e) == "text_delta") == "34567"
    assert (
        tail[0].offset == live[-2] and tail[-1].offset == live[-1]
    )  # coalesced: the run keeps its last offset
    assert await collect(stream, key, from_offset=live[-1]) == []


async def test_client_streaming_append(stream: StreamHarness, unique: str) -> None:
    key = f"subagent:{unique}"
    await create(stream, key)

    async def batches():  # type: ignore[no-untyped-def]
        for i in range(4):
            yield pb.StreamAppendEventsRequest(key=key, events=deltas(f"{i}a", f"{i}b"))

    resp = await stream.stub.StreamAppendEvents(batches())
    info = await stream.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (resp.count, resp.last_offset, info.length) == (8, info.last_offset, 8)


async def test_unknown_key_and_foreign_reader_not_found(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"session:{unique}", owner="alice")
    for key, reader in ((f"session:{unique}-x", ""), (f"session:{unique}", "mallory")):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stream, key, reader=reader)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
    await append(stream, f"session:{unique}", deltas("ok"))
    await close(stream, f"session:{unique}")
    assert len(await collect(stream, f"session:{unique}", reader="alice")) == 2


async def test_invalid_subscribe_arguments(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"session:{unique}")
    for kw in ({"from_offset": "abc"}, {"idle_timeout_ms": -1}):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stream, f"session:{unique}", **kw)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_size_cap(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory(max_events=5)
    key = f"session:{unique}"
    await create(h, key)
    await append(h, key, deltas("a", "b", "c"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await append(h, key, deltas("d", "e", "f"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cap of 5" in (err.value.details() or "")
    info = await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (info.length, info.closed) == (3, False)  # unchanged and still open
    await append(h, key, deltas("d", "e"))
    assert (await close(h, key)).closed  # the terminal event always fits
    events_ = await collect(h, key)
    assert "".join(e.text_delta.text_delta for e in events_) == "abcde"


async def test_expiry_after_ttl(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory(ttl_s=0.3)
    key = f"session:{unique}"
    await create(h, key)
    await append(h, key, deltas("a"))
    await close(h, key)
    assert (await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists

    async def gone() -> bool:
        if isinstance(h.backend, MemoryBackend):  # removed by the sweep, not only hidden on access
            return h.backend.stats().buffers == 0
        return not (await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists

    await wait_until(gone, 5, "expiry")
    assert not (await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await collect(h, key)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_open_buffer_does_not_expire(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory(ttl_s=0.05)
    key = f"session:{unique}"
    await create(h, key)
    sub = asyncio.create_task(collect(h, key, idle_timeout_ms=300))
    events_ = await asyncio.wait_for(sub, 5)  # waits out several TTLs
    assert [events.kind(e) for e in events_] == ["error"]
    assert (await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists


async def test_abandoned_open_buffer_expires_and_is_replaced(
    stream_factory: StreamFactory, unique: str
) -> None:
    h = await stream_factory(open_ttl_s=0.3)
    key = f"session:{unique}"
    await create(h, key)
    old = await append(h, key, deltas("a", "b"))  # ...and its writer dies without closing
    follower = asyncio.create_task(collect(h, key, idle_timeout_ms=300))

    async def gone() -> bool:  # waiting out the TTL is what this test is about
        if isinstance(h.backend, MemoryBackend):  # removed by the sweep, not only hidden on access
            return h.backend.stats().buffers == 0
        assert isinstance(h.backend, RedisBackend)
        return await h.backend.client.exists(*h.backend._keys(key)) == 0

    await wait_until(gone, 2, "abandoned buffer expiry")
    assert not (await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))).exists

    await create(h, key, owner="bob")  # the next turn is not refused
    new = await append(h, key, deltas("c"))
    assert as_int(new[0]) > as_int(old[-1])  # offsets never reused across the replacement
    info = await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (info.exists, info.closed, info.length, info.owner) == (True, False, 1, "bob")

    followed = await asyncio.wait_for(follower, 5)  # the follower of the abandoned buffer did not hang
    assert followed[0].text_delta.text_delta == "ab"
    assert followed[-1].error.code == "idle_timeout"


async def test_open_buffer_kept_alive_by_appends(stream_factory: StreamFactory, unique: str) -> None:
    ttl_s = 0.3
    h = await stream_factory(open_ttl_s=ttl_s)
    key = f"session:{unique}"
    redis = h.backend.client if isinstance(h.backend, RedisBackend) else None
    keys = h.backend._keys(key) if isinstance(h.backend, RedisBackend) else []
    started = time.monotonic()
    await create(h, key)
    if redis is not None:
        assert 0 < await redis.pttl(keys[0]) <= ttl_s * 1000  # an open buffer carries the open TTL
    appended = 0
    while time.monotonic() - started < 2 * ttl_s:  # appends well within the TTL, for two TTLs
        await asyncio.sleep(ttl_s / 4)
        before = [await redis.pttl(k) for k in keys] if redis is not None else []
        await append(h, key, deltas(str(appended)))
        appended += 1
        if redis is not None:
            after = [await redis.pttl(k) for k in keys]
            assert all(0 < a <= ttl_s * 1000 for a in after)
            assert after[0] > before[0]  # the append refreshed the expiry
            if before[1] > 0:  # the stream key exists from the first append on
                assert after[1] > before[1]

    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await create(h, key)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = await h.stub.GetStreamInfo(pb.GetStreamInfoRequest(key=key))
    assert (info.exists, info.closed, info.length) == (True, False, appended)

    closed = await close(h, key)  # closing hands the buffer to the closed TTL
    assert closed.closed
    if redis is not None:
        assert all(ms > ttl_s * 1000 for ms in [await redis.pttl(k) for k in keys])


async def test_idle_timeout_ends_with_error(stream: StreamHarness, unique: str) -> None:
    key = f"session:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("a"))
    started = time.monotonic()
    got = await asyncio.wait_for(collect(stream, key, idle_timeout_ms=200), 5)
    assert [events.kind(e) for e in got] == ["text_delta", "error"]
    assert got[-1].error.code == "idle_timeout" and got[-1].offset == ""
    assert time.monotonic() - started >= 0.2
    assert stream.backend.subscribers == 0


async def test_slow_consumer_bounded_memory(stream: StreamHarness, unique: str) -> None:
    key = f"session:{unique}"
    await create(stream, key)
    resume = asyncio.Event()
    first = asyncio.Event()
    received: list[ev.Event] = []

    async def slow() -> None:
        async for response in stream.stub.SubscribeStream(pb.SubscribeStreamRequest(key=key)):
            received.append(response.event)
            first.set()
            await resume.wait()

    task = asyncio.create_task(slow())
    expected = []
    await append(stream, key, deltas("start"))
    await asyncio.wait_for(first.wait(), 5)
    for chunk in range(50):  # 5,000 deltas while the subscriber is not reading
        texts = [f"<{chunk}.{i}>" for i in range(100)]
        expected += texts
        await append(stream, key, deltas(*texts))
    assert stream.backend.subscribers == 1
    resume.set()
    await close(stream, key)
    await asyncio.wait_for(task, 20)

    text = "".join(e.text_delta.text_delta for e in received if events.kind(e) == "text_delta")
    assert text == "start" + "".join(expected)
    assert events.kind(received[-1]) == "done"
    assert len(received) < 5_002  # the lagging reader got coalesced batches
    stats = stream.backend.stats()
    assert 0 < stats.max_batch_held <= BATCH  # what a subscriber holds is bounded, whatever its lag
    assert stats.subscribers == 0
    if isinstance(stream.backend, MemoryBackend):  # a subscriber is an index into the one shared buffer
        assert stats.buffers == 1 and stats.events == 5_002


async def test_cancelled_subscription_releases(stream: StreamHarness, unique: str) -> None:
    key = f"session:{unique}"
    await create(stream, key)
    call = stream.stub.SubscribeStream(pb.SubscribeStreamRequest(key=key))
    await append(stream, key, deltas("a"))
    assert (await call.read()).event.text_delta.text_delta == "a"
    assert stream.backend.subscribers == 1
    call.cancel()
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "subscription released")


async def test_stop_ends_subscriptions_promptly(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory()
    key = f"session:{unique}"
    await create(h, key)
    call = h.stub.SubscribeStream(pb.SubscribeStreamRequest(key=key))
    await append(h, key, deltas("a"))
    await call.read()
    started = time.monotonic()
    await asyncio.wait_for(h.server.stop(30.0), 5)  # far below the 30 s grace
    assert time.monotonic() - started < 5
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert h.backend.subscribers == 0
