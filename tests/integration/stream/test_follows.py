"""FollowStreams, many subscriptions on one call, over real gRPC on the memory and Redis backends: each
follow replays then follows live to its terminal event, reading as the user of its own token; a follow
fails alone; what becomes ready for several follows at once travels in one response; a follow is sent
no more than its window beyond what its reader granted back; releases, the caller's half-close and the
service's stop end what they should. Then the process's Follower (libs/streams/follower.py) over it:
what the gateway's readers and the orchestrator's turns use, one call for all of a process's follows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import NotFound, Shutdown, Unauthenticated, Unavailable, from_rpc_error
from agentmesh.libs.identity import Signer
from agentmesh.libs.streams.follower import FollowCancelled
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.stream.v1 import stream_service_pb2 as pb
from tests.integration.stream.conftest import RedisRelay, StreamFactory, StreamHarness, append, close, create
from tests.mesh import wait_until


def reasoning(*texts: str) -> list[ev.Event]:
    return [events.reasoning_delta(t) for t in texts]  # readers merge text deltas, not these


def follow(
    follow_id: int, key: str, identity: str = "", window: int = 0, **subscription: Any
) -> pb.StreamFollow:
    return pb.StreamFollow(
        id=follow_id,
        subscription=pb.SubscribeStreamRequest(key=key, **subscription),
        identity=identity,
        window=window,
    )


class Follows:
    """One FollowStreams call driven request by request, its deliveries gathered by follow id."""

    def __init__(self, h: StreamHarness, caller: str = "") -> None:
        self.requests: asyncio.Queue[pb.FollowStreamsRequest | None] = asyncio.Queue()
        with identity.acting_as(caller):
            self.call = h.stub.FollowStreams(self._feed())
        self.got: dict[int, list[ev.Event]] = {}
        self.ended: dict[int, pb.StreamDelivery] = {}
        self.responses: list[pb.FollowStreamsResponse] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.reader = asyncio.ensure_future(self._read())

    async def _feed(self) -> AsyncIterator[pb.FollowStreamsRequest]:
        while (request := await self.requests.get()) is not None:
            yield request

    async def _read(self) -> grpc.StatusCode:
        try:
            async for response in self.call:
                self.responses.append(response)
                for delivery in response.deliveries:
                    self.got.setdefault(delivery.id, []).extend(delivery.events)
                    if delivery.ended:
                        self.ended[delivery.id] = delivery
        except grpc.aio.AioRpcError as exc:
            self.error = exc
            return exc.code()
        return grpc.StatusCode.OK

    def send(self, **request: Any) -> None:
        self.requests.put_nowait(pb.FollowStreamsRequest(**request))

    def texts(self, follow_id: int) -> list[str]:
        got = self.got.get(follow_id, [])
        return [e.reasoning_delta.reasoning_delta for e in got if e.HasField("reasoning_delta")]

    async def end(self) -> grpc.StatusCode:
        self.requests.put_nowait(None)
        return await asyncio.wait_for(self.reader, 10)


async def test_a_follow_replays_then_follows_live_to_its_end(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, reasoning("a", "b"))
    follows = Follows(stream)
    follows.send(follows=[follow(1, key)])
    await wait_until(lambda: follows.texts(1) == ["a", "b"], what="the replay")
    await append(stream, key, reasoning("c"))
    await wait_until(lambda: follows.texts(1) == ["a", "b", "c"], what="the live event")
    done = await close(stream, key)
    await wait_until(lambda: 1 in follows.ended, what="the end")
    assert follows.got[1][-1].offset == done.offset and follows.got[1][-1].HasField("done")
    assert not follows.ended[1].error_reason
    follows.send(follows=[follow(2, key, from_offset=follows.got[1][1].offset)])  # resume after "b"
    await wait_until(lambda: 2 in follows.ended, what="the resumed follow's end")
    assert follows.texts(2) == ["c"] and follows.got[2][-1].HasField("done")
    assert await follows.end() == grpc.StatusCode.OK


async def test_follows_read_as_the_user_of_their_token_and_fail_alone(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """Another user's buffer reads as missing, a forged token is refused, a bad key is named: each
    follow ends with its reason and the call goes on; no token reads as the call's caller."""
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    await append(stream, key, reasoning("x"))
    forged = signer.mint("alice")[:-4] + "AAAA"
    follows = Follows(stream)
    follows.send(
        follows=[
            follow(1, key, identity=signer.mint("bob")),
            follow(2, key, identity=forged),
            follow(3, "nonsense", identity=signer.mint("alice")),
            follow(4, f"trace:{unique}-none", identity=signer.mint("alice")),
            follow(5, key, identity=signer.mint("alice"), idle_timeout_ms=200),
            follow(6, key, idle_timeout_ms=200),  # the call's caller: the mesh
        ]
    )
    await wait_until(lambda: len(follows.ended) == 6, what="every follow's end")
    reasons = {i: follows.ended[i].error_reason for i in range(1, 5)}
    assert reasons == {1: "NOT_FOUND", 2: "UNAUTHENTICATED", 3: "INVALID_ARGUMENT", 4: "NOT_FOUND"}
    assert [follows.got.get(i, []) for i in range(1, 5)] == [[]] * 4  # nothing of the buffer leaked
    for i in (5, 6):  # read, then the idle timeout (an error event, its last)
        assert follows.texts(i) == ["x"] and follows.got[i][-1].error.code == ev.ERROR_CODE_IDLE_TIMEOUT
    assert await follows.end() == grpc.StatusCode.OK


async def test_a_follow_of_a_user_call_is_that_users(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    follows = Follows(stream, caller="bob")
    follows.send(follows=[follow(1, key)])
    await wait_until(lambda: 1 in follows.ended, what="the follow's end")
    assert follows.ended[1].error_reason == "NOT_FOUND"
    assert await follows.end() == grpc.StatusCode.OK


async def test_what_is_ready_for_several_follows_goes_in_one_response(
    stream_factory: StreamFactory, unique: str
) -> None:
    h = await stream_factory()
    if not isinstance(h.backend, MemoryBackend):
        pytest.skip("appends in one pass of the loop: the memory backend")
    keys = [f"trace:{unique}-{i}" for i in range(5)]
    for key in keys:
        await create(h, key)
    follows = Follows(h)
    follows.send(follows=[follow(i, key) for i, key in enumerate(keys)])
    await wait_until(lambda: h.backend.subscribers == 5, what="five follows waiting")
    before = len(follows.responses)
    for key in keys:  # one pass of the service's loop: the backend called in-process
        await h.backend.append(key, reasoning(f"to {key}"))
    await wait_until(lambda: all(follows.texts(i) for i in range(5)), what="every follow's event")
    assert len(follows.responses) - before == 1
    for key in keys:
        await close(h, key)
    assert await follows.end() == grpc.StatusCode.OK


async def test_a_follow_is_sent_no_more_than_its_window_beyond_its_grants(
    stream: StreamHarness, unique: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    await append(stream, key, reasoning(*"abcde"))
    follows = Follows(stream)
    follows.send(follows=[follow(1, key, window=2)])
    await wait_until(lambda: follows.texts(1) == ["a", "b"], what="the window's worth")
    await close(stream, key)
    follows.send(follows=[follow(2, key)])  # reads it all: by its end, follow 1 got what it could
    await wait_until(lambda: 2 in follows.ended, what="the unbounded follow's end")
    assert follows.texts(1) == ["a", "b"] and 1 not in follows.ended
    follows.send(grants=[pb.StreamGrant(id=1, events=10)])
    await wait_until(lambda: 1 in follows.ended, what="the rest after the grant")
    assert follows.texts(1) == list("abcde") and follows.got[1][-1].HasField("done")
    assert await follows.end() == grpc.StatusCode.OK


async def test_a_released_follow_stops_and_a_half_closed_call_ends_with_its_follows(
    stream: StreamHarness, unique: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    follows = Follows(stream)
    follows.send(follows=[follow(1, key), follow(2, key), follow(1, key)])  # the second 1: refused
    await wait_until(lambda: stream.backend.subscribers == 2, what="two follows")
    await wait_until(lambda: 1 in follows.ended, what="the duplicate's end")
    assert follows.ended[1].error_reason == "INVALID_ARGUMENT"
    follows.ended.clear()
    follows.send(releases=[1])
    await wait_until(lambda: stream.backend.subscribers == 1, what="the release")
    follows.requests.put_nowait(None)  # half-close: the call ends once follow 2 ended
    await append(stream, key, reasoning("x"))
    await wait_until(lambda: follows.texts(2) == ["x"], what="follow 2, still served")
    assert not follows.reader.done()
    await close(stream, key)
    assert await asyncio.wait_for(follows.reader, 10) == grpc.StatusCode.OK
    assert follows.texts(2) == ["x"] and 1 not in follows.ended


async def test_a_stop_ends_every_follow_shutdown(stream_factory: StreamFactory, unique: str) -> None:
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    follows = Follows(h)
    follows.send(follows=[follow(1, key), follow(2, key, terminal_only=True)])
    await wait_until(lambda: h.backend.subscribers == 2, what="two follows")
    await asyncio.wait_for(h.server.stop(30.0), 5)
    assert await asyncio.wait_for(follows.reader, 10) == grpc.StatusCode.UNAVAILABLE
    assert follows.error is not None and isinstance(from_rpc_error(follows.error), Shutdown)
    assert {i: d.error_reason for i, d in follows.ended.items()} == {1: "SHUTDOWN", 2: "SHUTDOWN"}


# --- the Follower ---------------------------------------------------------------------------------------


def clients_for(h: StreamHarness, signer: Signer) -> Clients:
    settings = h.settings.model_copy(deep=True)
    settings.addresses.stream = h.server.target
    settings.stream.reconnect_s = 1.0  # a service stopped for good fails its follows soon
    return Clients(settings, signer)


def counted(clients: Clients) -> list[int]:
    calls = [0]
    real = clients.stream.FollowStreams

    def follow_streams(requests: Any, **kw: Any) -> Any:
        calls[0] += 1
        return real(requests, **kw)

    clients.stream.FollowStreams = follow_streams  # type: ignore[method-assign]
    return calls


async def test_the_follower_reads_many_buffers_on_one_call_as_their_users(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    mine, bobs = f"trace:{unique}-alice", f"trace:{unique}-bob"
    await create(stream, mine, owner="alice")
    await create(stream, bobs, owner="bob")
    clients = clients_for(stream, signer)
    calls = counted(clients)
    try:
        with identity.acting_as("alice"):
            alice = clients.follows.follow(mine)
            nosy = clients.follows.follow(bobs)
            end = clients.follows.follow(mine, terminal_only=True)
        with identity.acting_as("bob"):
            bob = clients.follows.follow(bobs)
        await append(stream, mine, reasoning(*(f"{i} " for i in range(600))))  # past the window
        await close(stream, mine)
        await append(stream, bobs, reasoning("b"))
        await close(stream, bobs)
        got = [e async for e in alice]
        assert "".join(e.reasoning_delta.reasoning_delta for e in got[:-1]) == "".join(
            f"{i} " for i in range(600)
        )
        assert got[-1].HasField("done") and alice.ended
        assert [events.kind(e) for e in [e async for e in end]] == ["done"]
        assert [events.kind(e) for e in [e async for e in bob]] == ["reasoning_delta", "done"]
        with pytest.raises(NotFound):
            await anext(nosy)
    finally:
        await clients.close()
    assert calls == [1]


async def test_a_cancelled_follow_lets_go_and_a_failed_call_fails_its_follows(
    stream_factory: StreamFactory, signer: Signer, unique: str
) -> None:
    h = await stream_factory()
    key = f"trace:{unique}"
    await create(h, key)
    clients = clients_for(h, signer)
    try:
        left = clients.follows.follow(key)
        stays = clients.follows.follow(key)
        await wait_until(lambda: h.backend.subscribers == 2, what="two follows")
        left.cancel()
        await wait_until(lambda: h.backend.subscribers == 1, what="the service let go")
        with pytest.raises(FollowCancelled):
            await anext(left)
        await h.server.stop(1.0)
        with pytest.raises((Shutdown, Unavailable)):
            await asyncio.wait_for(anext(stays), 10)
    finally:
        await clients.close()


async def test_a_retired_follow_call_ends_with_its_last_follow(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """Past its life a call takes no new follow (a new call does) and ends once its follows ended."""
    old, new = f"trace:{unique}-old", f"trace:{unique}-new"
    await create(stream, old)
    await create(stream, new)
    clients = clients_for(stream, signer)
    calls = counted(clients)
    try:
        first = clients.follows.follow(old)
        call = first._call
        assert call is not None
        clients.follows._life_s = 0.0
        second = clients.follows.follow(new)
        clients.follows._life_s = 3600.0
        assert calls == [2] and second._call is not call
        await close(stream, old)
        assert [events.kind(e) async for e in first] == ["done"]
        await wait_until(call.done, what="the old call's end")
        await close(stream, new)
        assert [events.kind(e) async for e in second] == ["done"]
    finally:
        await clients.close()


async def test_a_follow_of_a_forged_identity_is_refused(
    stream: StreamHarness, signer: Signer, unique: str
) -> None:
    """A follow made while no user acts reads as the mesh; the tokens the Follower mints are the
    service's to verify (one from another mesh's secret is refused)."""
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    clients = clients_for(stream, signer)
    clients.follows._signer = Signer(b"another mesh's secret, not ours!")
    try:
        with identity.acting_as("alice"):
            refused = clients.follows.follow(key)
        with pytest.raises(Unauthenticated):
            await anext(refused)
    finally:
        await clients.close()


@pytest.mark.parametrize("backend_kind", [pytest.param("redis", marks=pytest.mark.redis)], indirect=True)
async def test_a_follow_whose_backend_loses_redis_ends_with_an_error(
    stream_factory: StreamFactory, redis_relay: RedisRelay, unique: str
) -> None:
    """Redis goes away under a live follow (the backend's own ConnectionError, not a MeshError): the
    follow ends, with a reason, in a response after the one that carried its last event; the call stays
    usable; nothing waits for ever."""
    h = await stream_factory(via=redis_relay.url)
    key = f"trace:{unique}"
    await create(h, key)
    follows = Follows(h)
    follows.send(follows=[follow(1, key)])
    await append(h, key, reasoning("before"))
    await wait_until(lambda: follows.texts(1) == ["before"], what="the event before")
    redis_relay.cut()
    await wait_until(lambda: 1 in follows.ended, timeout=30, what="the follow's end")
    assert follows.ended[1].error_reason == "UNAVAILABLE" and "Redis" in follows.ended[1].error_message
    assert await follows.end() == grpc.StatusCode.OK  # the call ends once it has no follow left


LIVE_FOLLOWS = 150


@pytest.mark.parametrize("backend_kind", [pytest.param("redis", marks=pytest.mark.redis)], indirect=True)
async def test_live_follows_on_redis_share_one_read_whatever_their_number(
    stream_factory: StreamFactory, signer: Signer, unique: str
) -> None:
    """The live follows of a stream service on Redis wait in one XREAD BLOCK, not one connection each
    (docs/design/streams.md, "The service side"): 150 of them on a pool of 10 connections each get
    their event and their end, and the writes beside them go through."""
    stream = await stream_factory(redis_max_connections=10)
    keys = [f"trace:{unique}-{i}" for i in range(LIVE_FOLLOWS)]
    for key in keys:
        await create(stream, key)
    clients = clients_for(stream, signer)
    try:
        with identity.acting_as("alice"):
            follows = [clients.follows.follow(key) for key in keys]
        reads = [asyncio.ensure_future(_events(f)) for f in follows]
        await wait_until(
            lambda: stream.backend.subscribers == LIVE_FOLLOWS, timeout=30, what="every follow reading"
        )
        for i, key in enumerate(keys):
            await append(stream, key, reasoning(f"r{i}"))
            await close(stream, key)
        got = await asyncio.wait_for(asyncio.gather(*reads), 30)
    finally:
        await clients.close()
    for i, events_of in enumerate(got):
        assert [events.kind(e) for e in events_of] == ["reasoning_delta", "done"]
        assert events_of[0].reasoning_delta.reasoning_delta == f"r{i}"


async def _events(follow: Any) -> list[ev.Event]:
    return [e async for e in follow]


@pytest.mark.parametrize("backend_kind", [pytest.param("redis", marks=pytest.mark.redis)], indirect=True)
async def test_a_follow_on_redis_never_reads_a_later_buffer_of_its_key(
    stream: StreamHarness, unique: str
) -> None:
    """Each entry names the buffer that wrote it (docs/design/streams.md): a follow of a buffer whose key
    was made anew under it (its meta expired, CreateStream made another) reads none of the new buffer's
    events and idles out; an entry without a name (an earlier version's) is checked against the meta."""
    key = f"trace:{unique}"
    backend, redis = stream.backend, stream.redis
    assert redis is not None
    meta_key, stream_key = stream.redis_keys(key)
    await create(stream, key)
    await append(stream, key, reasoning("mine"))
    old = backend.subscribe(key, "", "alice", idle_timeout_ms=1500)
    assert (await anext(old)).reasoning_delta.reasoning_delta == "mine"
    reading = asyncio.ensure_future(anext(old))  # waiting live for the next entry
    await redis.delete(meta_key)  # the abandoned buffer's meta expired
    await create(stream, key)
    await append(stream, key, reasoning("theirs"))
    ended = await asyncio.wait_for(reading, 10)
    assert ended.HasField("error") and ended.error.code == ev.ERROR_CODE_IDLE_TIMEOUT, ended
    await old.aclose()

    new = backend.subscribe(key, "", "alice", idle_timeout_ms=1500)
    assert (await anext(new)).reasoning_delta.reasoning_delta == "theirs"
    await redis.xadd(stream_key, {"e": events.reasoning_delta("unnamed").SerializeToString()})
    assert (await anext(new)).reasoning_delta.reasoning_delta == "unnamed"
    await new.aclose()
