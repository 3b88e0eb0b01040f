"""StreamService over real gRPC, parametrised over the memory and Redis backends. Buffers are read as
the mesh reads them, by follows on a FollowStreams call (libs.streams.follower.Follower; many follows on one
call: test_follows.py).

No test sleeps against a TTL: on memory the backend's ManualClock is moved; on Redis the keys' PTTL is
read (and shortened by the test where an append must be seen to refresh it), and where Redis must really
expire a buffer the TTL is short and the test polls for it with a deadline (tests.mesh.wait_until).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import MeshError, from_rpc_error
from agentmesh.libs.streams.follower import Follow
from agentmesh.services.stream.backend import BATCH
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.stream.v1 import stream_service_pb2 as pb
from tests.integration.stream.conftest import (
    RedisRelay,
    StreamFactory,
    StreamHarness,
    append,
    as_int,
    close,
    collect,
    create,
    deltas,
    follow,
    info,
)
from tests.mesh import wait_until


async def _rest(call: Follow) -> list[ev.Event]:
    """The rest of a follow's events."""
    return [e async for e in call]


async def test_lifecycle_offsets_and_errors(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
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
    found = await info(stream, key, reader="alice")
    assert (found.exists, found.closed, found.length) == (True, False, 3)
    assert found.last_offset == first[-1] and dict(found.metadata) == {"agent": "demo"}
    assert await info(stream, key) == found  # the mesh reads the same

    closed = await close(stream, key)
    assert closed.closed and as_int(closed.offset) > as_int(first[-1])
    again = await stream.stub.CloseStream(
        pb.CloseStreamRequest(key=key, error=ev.StreamError(code=ev.ERROR_CODE_INTERNAL, message="y"))
    )
    assert (again.closed, again.offset) == (False, closed.offset)
    events_ = await collect(stream, key)
    assert [events.kind(e) for e in events_] == ["text_delta", "done"]  # the second close changed nothing
    assert events_[-1].offset == closed.offset

    with pytest.raises(grpc.aio.AioRpcError) as after_close:
        await append(stream, key, deltas("late"))
    assert after_close.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    with pytest.raises(grpc.aio.AioRpcError) as taken:
        await create(stream, key, owner="bob")  # another user cannot take over the key
    assert taken.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await create(stream, key)  # its owner replaces the closed buffer
    second = await append(stream, key, deltas("new"))
    assert as_int(second[0]) > as_int(closed.offset)  # offsets never reused
    replay = await info(stream, key, reader="alice")
    assert (replay.exists, replay.length, replay.closed) == (True, 1, False)
    assert not (await info(stream, key, reader="bob")).exists

    unknown = await info(stream, f"a2a:{unique}-none")
    assert not unknown.exists
    hidden = await info(stream, key, reader="mallory")
    assert not hidden.exists


@pytest.mark.parametrize(
    "key",
    ["foo:1", "session", "trace:", "subagent:" + "x" * 65, "subagent:" + "x" * 201, "trace:a:b", ""],
)
async def test_invalid_key(stream: StreamHarness, key: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await create(stream, key)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "invalid stream key" in (err.value.details() or "")


async def test_close_requires_outcome(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"trace:{unique}")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.stub.CloseStream(pb.CloseStreamRequest(key=f"trace:{unique}"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (await info(stream, f"trace:{unique}")).closed


async def test_close_appends_its_events_before_the_terminal(stream: StreamHarness, unique: str) -> None:
    """A turn's `finish` and `done` in one CloseStream: the events first, in order, then the end; a
    buffer already closed takes none of them; a terminal event among them is refused."""
    key = f"trace:{unique}"
    await create(stream, key)
    first = await append(stream, key, deltas("a"))
    finish = ev.Event(finish=ev.TurnFinish(finish_reason=ev.FINISH_REASON_STOP, model="m"))
    with pytest.raises(grpc.aio.AioRpcError) as terminal:
        await stream.stub.CloseStream(
            pb.CloseStreamRequest(key=key, events=[events.done()], done=ev.StreamDone())
        )
    assert terminal.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (await info(stream, key)).closed  # a refused close changes nothing

    resp = await stream.stub.CloseStream(
        pb.CloseStreamRequest(key=key, events=[finish, deltas("b")[0]], done=ev.StreamDone())
    )
    assert resp.closed and len(resp.offsets) == 2
    assert as_int(first[0]) < as_int(resp.offsets[0]) < as_int(resp.offsets[1]) < as_int(resp.offset)
    stored = await collect(stream, key)
    assert [events.kind(e) for e in stored] == ["text_delta", "finish", "text_delta", "done"]
    assert [e.offset for e in stored[1:]] == [*resp.offsets, resp.offset]

    with pytest.raises(grpc.aio.AioRpcError) as closed:
        await stream.stub.CloseStream(pb.CloseStreamRequest(key=key, events=[finish], done=ev.StreamDone()))
    assert closed.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (await info(stream, key)).length == 4  # nothing appended after the end


async def test_replay_then_live(stream: StreamHarness, unique: str) -> None:
    key = f"a2a:{unique}"
    await create(stream, key)
    early = await append(stream, key, [*deltas("0", "1", "2"), events.reasoning_delta("think")])
    got: list[ev.Event] = []
    caught_up = asyncio.Event()

    async def subscriber() -> None:
        async for event in follow(stream, key, reader="alice"):  # the owner reads
            got.append(event)
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
    assert tail[0].offset == live[-2]  # coalesced: the run keeps its last offset
    assert tail[-1].offset == live[-1]
    assert await collect(stream, key, from_offset=live[-1]) == []


async def test_terminal_only(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("a", "b"))
    closed = await close(stream, key)
    only = await collect(stream, key, terminal_only=True)
    assert [(events.kind(e), e.offset) for e in only] == [("done", closed.offset)]


async def test_unknown_key_and_foreign_reader_not_found(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"trace:{unique}", owner="alice")
    for key, reader in ((f"trace:{unique}-x", ""), (f"trace:{unique}", "mallory")):
        with pytest.raises(MeshError) as err:
            await collect(stream, key, reader=reader)
        assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND
    await append(stream, f"trace:{unique}", deltas("ok"))
    await close(stream, f"trace:{unique}")
    assert len(await collect(stream, f"trace:{unique}", reader="alice")) == 2
    assert len(await collect(stream, f"trace:{unique}")) == 2  # the mesh reads any buffer


async def test_invalid_subscribe_arguments(stream: StreamHarness, unique: str) -> None:
    await create(stream, f"trace:{unique}")
    for kw in ({"from_offset": "abc"}, {"idle_timeout_ms": -1}):
        with pytest.raises(MeshError) as err:
            await collect(stream, f"trace:{unique}", **kw)
        assert err.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT


async def test_size_cap(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory(max_events=5)
    key = f"trace:{unique}"
    await create(h, key)
    await append(h, key, deltas("a", "b", "c"))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await append(h, key, deltas("d", "e", "f"))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "cap of 5" in (err.value.details() or "")
    found = await info(h, key)
    assert (found.length, found.closed) == (3, False)  # unchanged and still open
    await append(h, key, deltas("d", "e"))
    assert (await close(h, key)).closed  # the terminal event always fits
    events_ = await collect(h, key)
    assert "".join(e.text_delta.text_delta for e in events_) == "abcde"


async def test_expiry_after_ttl(stream_factory: StreamFactory, backend_kind: str, unique: str) -> None:
    ttl_s = 0.3 if backend_kind == "memory" else 1.0  # memory: on its ManualClock; Redis: a short real TTL
    h = await stream_factory(ttl_s=ttl_s)
    key = f"trace:{unique}"
    await create(h, key)
    await append(h, key, deltas("a"))
    await close(h, key)
    assert (await info(h, key)).exists
    if isinstance(h.backend, MemoryBackend):
        assert h.clock is not None
        h.clock.advance(ttl_s * 0.9)
        assert h.backend.sweep() == 0 and h.backend.stats().buffers == 1  # not yet
        h.clock.advance(ttl_s * 0.2)
    else:
        assert h.redis is not None
        pttl = [await h.redis.pttl(k) for k in h.redis_keys(key)]
        assert all(0 < ms <= ttl_s * 1000 for ms in pttl), pttl  # closing set the closed TTL on both keys

    async def gone() -> bool:
        if isinstance(h.backend, MemoryBackend):  # removed by the background sweep, not only hidden on access
            return h.backend.stats().buffers == 0
        assert h.redis is not None
        return await h.redis.exists(*h.redis_keys(key)) == 0

    await wait_until(gone, 5, "expiry")
    assert not (await info(h, key)).exists
    with pytest.raises(MeshError) as err:
        await collect(h, key)
    assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND


async def test_an_open_buffer_outlives_the_closed_ttl(stream_factory: StreamFactory, unique: str) -> None:
    ttl_s = 0.05  # only closed buffers expire that fast; an open one holds its lease (30 s)
    h = await stream_factory(ttl_s=ttl_s)
    key = f"trace:{unique}"
    await create(h, key)
    await append(h, key, deltas("a"))
    if isinstance(h.backend, MemoryBackend):
        assert h.clock is not None
        h.clock.advance(ttl_s * 100)  # many closed TTLs later, within the lease
        assert h.backend.sweep() == 0
    else:
        assert h.redis is not None
        pttl = [await h.redis.pttl(k) for k in h.redis_keys(key)]
        assert all(ttl_s * 100 * 1000 < ms for ms in pttl), pttl  # the open keys' TTL, not ttl_s
    got = await asyncio.wait_for(collect(h, key, idle_timeout_ms=300), 5)
    assert [events.kind(e) for e in got] == ["text_delta", "error"]
    assert got[-1].error.code == ev.ERROR_CODE_IDLE_TIMEOUT
    found = await info(h, key)
    assert (found.exists, found.closed, found.length) == (True, False, 1)


async def _lease_runs_out(h: StreamHarness, lease_s: float) -> None:
    """Memory: the clock moves past the lease and the sweep runs; Redis: real time, the backend's own
    background sweep (every quarter lease) ends the buffer."""
    if isinstance(h.backend, MemoryBackend):
        assert h.clock is not None
        h.clock.advance(lease_s * 1.1)
        assert h.backend.sweep() == 1


async def test_an_abandoned_open_buffer_is_ended_for_its_readers(
    stream_factory: StreamFactory, backend_kind: str, unique: str
) -> None:
    """Its writer died (no append, no renewal for the lease): every reader gets an `interrupted` error
    as its last event, and the owner may start the key again; nobody else may take it."""
    lease_s = 0.3 if backend_kind == "memory" else 0.5  # memory: on its ManualClock; Redis: real time
    h = await stream_factory(lease_s=lease_s)
    key = f"trace:{unique}"
    await create(h, key)
    old = await append(h, key, deltas("a", "b"))  # ...and its writer dies without closing
    call = follow(h, key, reader="alice", idle_timeout_ms=10_000)
    followed = [await anext(call)]  # following before the buffer is abandoned
    follower = asyncio.create_task(_rest(call))
    await _lease_runs_out(h, lease_s)
    followed += await asyncio.wait_for(follower, 5)  # ended by the lease, long before its idle timeout
    assert [events.kind(e) for e in followed] == ["text_delta", "error"]
    assert followed[0].text_delta.text_delta == "ab"
    assert followed[-1].error.code == ev.ERROR_CODE_INTERRUPTED and followed[-1].offset
    late = await collect(h, key, reader="alice")  # a late reader replays to the same end
    assert [e.offset for e in late][-1] == followed[-1].offset
    assert (await info(h, key)).closed

    with pytest.raises(grpc.aio.AioRpcError) as taken:
        await create(h, key, owner="bob")
    assert taken.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await create(h, key)  # the owner's next turn is not refused
    new = await append(h, key, deltas("c"))
    assert as_int(new[0]) > as_int(old[-1])  # offsets never reused across the replacement
    found = await info(h, key, reader="alice")
    assert (found.exists, found.closed, found.length) == (True, False, 1)


async def test_appends_and_renewals_keep_an_open_buffer_alive(
    stream_factory: StreamFactory, backend_kind: str, unique: str
) -> None:
    lease_s = 60.0
    h = await stream_factory(lease_s=lease_s)
    key = f"trace:{unique}"
    await create(h, key)
    written = 0
    if isinstance(h.backend, MemoryBackend):
        assert h.clock is not None
        for i in range(6):  # an append or a renewal every 3/4 lease: four leases later, still open
            h.clock.advance(lease_s * 0.75)
            if i % 2:
                await append(h, key, deltas(str(i)))
                written += 1
            else:
                assert (await h.stub.RenewStreams(pb.RenewStreamsRequest(keys=[key]))).renewed == 1
            assert h.backend.sweep() == 0
    else:
        assert h.redis is not None
        leases = f"{h.backend.prefix}leases"  # type: ignore[attr-defined]
        for i in range(4):  # as if most of the lease had passed: each write moves the deadline again
            await h.redis.zadd(leases, {key: 1})
            if i % 2:
                await append(h, key, deltas(str(i)))
                written += 1
            else:
                assert (await h.stub.RenewStreams(pb.RenewStreamsRequest(keys=[key]))).renewed == 1
            score = await h.redis.zscore(leases, key)
            assert score is not None and score > 1, score
            assert await h.backend.sweep() == []  # type: ignore[attr-defined]
    with identity.acting_as("alice"), pytest.raises(grpc.aio.AioRpcError) as denied:
        await h.stub.RenewStreams(pb.RenewStreamsRequest(keys=[key]))
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED  # leases are the mesh's business
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        await create(h, key)
    assert busy.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    found = await info(h, key)
    assert (found.exists, found.closed, found.length) == (True, False, written)
    await close(h, key)
    assert (await h.stub.RenewStreams(pb.RenewStreamsRequest(keys=[key]))).renewed == 0  # closed: no lease


async def test_idle_timeout_ends_with_error(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, deltas("a"))
    started = time.monotonic()
    got = await asyncio.wait_for(collect(stream, key, idle_timeout_ms=200), 5)
    assert [events.kind(e) for e in got] == ["text_delta", "error"]
    assert got[-1].error.code == ev.ERROR_CODE_IDLE_TIMEOUT and got[-1].offset == ""
    assert time.monotonic() - started >= 0.2
    assert stream.backend.subscribers == 0


async def test_slow_consumer_bounded_memory(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    resume = asyncio.Event()
    first = asyncio.Event()
    received: list[ev.Event] = []

    async def slow() -> None:
        async for event in follow(stream, key):
            received.append(event)
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
    key = f"trace:{unique}"
    await create(stream, key)
    call = follow(stream, key)
    await append(stream, key, deltas("a"))
    assert (await anext(call)).text_delta.text_delta == "a"
    assert stream.backend.subscribers == 1
    call.cancel()
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "subscription released")


async def test_stop_ends_subscriptions_promptly(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    call = follow(h, key)
    await append(h, key, deltas("a"))
    await anext(call)
    started = time.monotonic()
    await asyncio.wait_for(h.server.stop(30.0), 5)  # far below the 30 s grace
    assert time.monotonic() - started < 5
    with pytest.raises(MeshError) as err:
        await anext(call)
    assert err.value.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert h.backend.subscribers == 0


async def test_a_buffer_born_with_its_first_events_and_several_created_at_once(
    stream: StreamHarness, unique: str
) -> None:
    """CreateStream's events are appended at creation (their offsets answered); a terminal one is
    refused with nothing created. BatchCreateStreams creates in order; the first that fails fails the
    call with its status, and those created before it stay."""
    born = f"trace:{unique}-born"
    start = ev.Event(start=ev.TurnStart(trace_id=unique, assistant_message_id=7))
    with identity.acting_as("alice"):
        resp = await stream.stub.CreateStream(pb.CreateStreamRequest(key=born, events=[start]))
        assert len(resp.offsets) == 1
        ending = pb.CreateStreamRequest(key=f"trace:{unique}-ending", events=[events.done()])
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.stub.CreateStream(ending)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not (await info(stream, f"trace:{unique}-ending")).exists
    got = await collect(stream, born, reader="alice", idle_timeout_ms=200)
    assert got[0].start.assistant_message_id == 7 and got[0].offset == resp.offsets[0]

    keys = [f"subagent:{unique}-{i}" for i in range(3)]
    with identity.acting_as("alice"):
        batch = await stream.stub.BatchCreateStreams(
            pb.BatchCreateStreamsRequest(
                requests=[pb.CreateStreamRequest(key=k, events=[start], metadata={"n": k}) for k in keys]
            )
        )
        assert [len(r.offsets) for r in batch.responses] == [1, 1, 1]
        again = [pb.CreateStreamRequest(key=f"subagent:{unique}-new"), pb.CreateStreamRequest(key=keys[1])]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.stub.BatchCreateStreams(pb.BatchCreateStreamsRequest(requests=again))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # keys[1] is open
        many = [pb.CreateStreamRequest(key=f"subagent:{unique}-m{i}") for i in range(101)]
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stream.stub.BatchCreateStreams(pb.BatchCreateStreamsRequest(requests=many))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (await info(stream, f"subagent:{unique}-new")).exists  # created before the failure: it stays
    assert not (await info(stream, f"subagent:{unique}-m0")).exists
    for k in keys:
        found = await info(stream, k, reader="alice")
        assert (found.length, found.metadata["n"]) == (1, k)


@pytest.mark.parametrize("backend_kind", [pytest.param("redis", marks=pytest.mark.redis)], indirect=True)
async def test_calls_of_a_service_that_lost_redis_fail_unavailable(
    stream_factory: StreamFactory, redis_relay: RedisRelay, unique: str
) -> None:
    """Redis gone (redis-py's ConnectionError under the backend): every kind of call fails UNAVAILABLE
    with a message that names Redis, so a caller knows to try again later; never INTERNAL, never a
    hang."""
    h = await stream_factory(via=redis_relay.url)
    key = f"trace:{unique}"
    await create(h, key)
    await append(h, key, deltas("before"))
    redis_relay.cut()
    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "create": lambda: create(h, f"trace:{unique}-new"),
        "append": lambda: append(h, key, deltas("after")),
        "close": lambda: close(h, key),
        "info": lambda: info(h, key),
        "subscribe": lambda: collect(h, key),
    }
    for what, call in calls.items():
        with pytest.raises((grpc.aio.AioRpcError, MeshError)) as err:
            await asyncio.wait_for(call(), 30)
        failed = err.value if isinstance(err.value, MeshError) else from_rpc_error(err.value)
        assert failed.grpc_code == grpc.StatusCode.UNAVAILABLE, what
        assert "Redis" in failed.message, what
