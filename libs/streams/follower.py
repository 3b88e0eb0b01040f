"""Many follows on one FollowStreams call: `Follower.follow(key, ...)` reads one buffer as an async
iterator of events (the protocol: docs/design/streams.md)."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import (
    Cancelled,
    Interrupted,
    MeshError,
    NotFound,
    Unavailable,
    from_reason,
    from_rpc_error,
)
from agentmesh.libs.identity import Signer
from agentmesh.libs.streams import end_calls
from agentmesh.libs.streams.reconnect import Reconnect, went_away
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc

WINDOW = 256  # events the service may send a follow beyond what its reader consumed


class FollowCancelled(Cancelled):
    """The follow was ended by its own reader (`Follow.cancel()`)."""


def acting_user() -> str:
    """The user acting now ("": the mesh itself)."""
    principal = identity.current()
    return "" if principal is None or principal.is_mesh else principal.user


class Follow:
    """One follow: its events as they come (the last one terminal), or its failure raised."""

    def __init__(self, follower: Follower, request: pb.StreamFollow, user: str) -> None:
        self._follower = follower
        self.request = request
        self.id = request.id
        self.user = user  # its reader ("": the mesh), whose token each request of it carries
        self.last_offset = request.subscription.from_offset  # of the last event delivered
        self.resumed = False  # followed again after its call failed (docs/design/streams.md#reconnects)
        self._events: collections.deque[ev.Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: MeshError | None = None
        self._unacked = 0  # consumed since the last grant
        self._call: _FollowCall | None = None

    def __aiter__(self) -> Follow:
        return self

    async def __anext__(self) -> ev.Event:
        while not self._events:
            if self._ended:
                if self._error is not None:
                    raise self._error
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        event = self._events.popleft()
        self._unacked += 1
        if self._unacked >= WINDOW // 2 and not self._ended and self._call is not None:
            self._call.grant(self.id, self._unacked)
            self._unacked = 0
        return event

    @property
    def ended(self) -> bool:
        return self._ended

    def cancel(self) -> None:
        """Stops following (the service lets go); a reader waiting gets FollowCancelled."""
        if self._ended:
            return
        if self._call is not None:
            self._call.release(self.id)  # before the end, which may half-close a retired call
        self._end(FollowCancelled(f"the follow of {self.request.subscription.key} was cancelled"))

    def _deliver(self, delivery: pb.StreamDelivery) -> None:
        if self._ended:
            return
        self._events.extend(delivery.events)
        for event in reversed(delivery.events):
            if event.offset:
                self.last_offset = event.offset
                break
        if delivery.ended:
            failed = delivery.error_reason
            err = from_reason(failed, delivery.error_message) if failed else None
            if went_away(err):  # the service stops (SHUTDOWN): followed again, there or elsewhere
                assert err is not None
                if self._call is not None:
                    self._call.forget(self.id)
                self._wake()
                self._follower.failed([self], err)
                return
            if self.resumed and isinstance(err, NotFound):
                key = self.request.subscription.key
                err = Interrupted(
                    f"the buffer of {key} is gone with the stream service that held it (it restarted "
                    f"while this follow read it): {err.message}"
                )
            self._end(err)
        else:
            self._wake()

    def _again(self, follow_id: int, token: str) -> None:
        """Followed again after its call failed: from the last event it was delivered."""
        self.request.id = self.id = follow_id
        self.request.identity = token
        self.request.subscription.from_offset = self.last_offset
        self._unacked = 0  # the new follow has a whole window
        self.resumed = True

    def _end(self, err: MeshError | None) -> None:
        self._ended = True
        self._error = err
        if self._call is not None:
            self._call.forget(self.id)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def _gone(delivery: pb.StreamDelivery) -> bool:
    """A follow ended as the service could not go on (stopping, or its backend unreachable): no answer
    that the stream service is back."""
    return delivery.error_reason != "" and went_away(from_reason(delivery.error_reason, ""))


class Follower:
    """The follows of one process, on one FollowStreams call at a time (a call lives half the streaming
    deadline, then new follows go on a new one while the old one ends with its last follow)."""

    def __init__(
        self,
        stub: Callable[[], stream_service_pb2_grpc.StreamServiceStub],
        signer: Signer,
        life_s: float,
        reconnect: Reconnect,
    ) -> None:
        self._stub = stub
        self._signer = signer
        self._life_s = life_s
        self._reconnect = reconnect
        self._ids = itertools.count(1)
        self._call: _FollowCall | None = None
        self._calls: set[_FollowCall] = set()
        self._closed = False
        self._resuming: set[asyncio.Task[None]] = set()

    def follow(
        self, key: str, from_offset: str = "", idle_timeout_ms: int = 0, terminal_only: bool = False
    ) -> Follow:
        """Follows `key` after `from_offset` as the user acting now (started at once: a caller may start
        it before it reads)."""
        user = acting_user()
        request = pb.StreamFollow(
            id=next(self._ids),
            subscription=pb.SubscribeStreamRequest(
                key=key, from_offset=from_offset, idle_timeout_ms=idle_timeout_ms, terminal_only=terminal_only
            ),
            identity=self._signer.mint(user) if user else "",
            window=WINDOW,
        )
        follow = Follow(self, request, user)
        self._current().add(follow)
        return follow

    def _current(self) -> _FollowCall:
        call = self._call
        loop = asyncio.get_running_loop()
        if call is None or call.done() or loop.time() - call.opened > self._life_s:
            if call is not None:
                call.retire()
            with identity.acting_as(""):  # the call is the mesh's; each follow carries its reader
                call = self._call = _FollowCall(self._stub().FollowStreams, self._calls.discard, self)
            self._calls.add(call)
        return call

    def answered(self) -> None:
        self._reconnect.reset()

    def failed(self, follows: list[Follow], err: MeshError) -> None:
        """`follows` lost their call with `err`: when the stream service went away, each is followed
        again from its last event once it answers (within the reconnect budget), else it ends with
        `err`."""
        if self._closed or not went_away(err):
            for follow in follows:
                follow._end(err)
            return
        for follow in follows:
            follow._call = None
        task = asyncio.get_running_loop().create_task(self._resume(follows, err))
        self._resuming.add(task)
        task.add_done_callback(self._resuming.discard)

    async def _resume(self, follows: list[Follow], err: MeshError) -> None:
        back = False
        try:
            back = await self._reconnect.wait()
        finally:  # (cancelled: the process closes its clients)
            for follow in follows:
                if follow.ended:  # cancelled by its reader meanwhile
                    continue
                if not back or self._closed:
                    follow._end(err)
                    continue
                follow._again(next(self._ids), self._signer.mint(follow.user) if follow.user else "")
                self._current().add(follow)

    async def aclose(self) -> None:
        """Ends every call (their follows raise Unavailable)."""
        self._closed = True
        for task in list(self._resuming):
            task.cancel()
        self._call = None
        calls, self._calls = list(self._calls), set()
        await end_calls(calls)


class _FollowCall:
    """One FollowStreams call: requests gathered in one pass of the loop go as one message; a task
    reads the deliveries and hands them to their follows."""

    def __init__(self, method: Any, on_done: Callable[[_FollowCall], None], follower: Follower) -> None:
        loop = asyncio.get_running_loop()
        self.opened = loop.time()
        self._follower = follower
        self._follows: dict[int, Follow] = {}
        self._queue: asyncio.Queue[pb.FollowStreamsRequest | None] = asyncio.Queue()
        self._pending: pb.FollowStreamsRequest | None = None
        self._retired = False
        self._half_closed = False
        self.call = method(self._requests())
        self.reader = loop.create_task(self._read())
        self.reader.add_done_callback(lambda _: on_done(self))

    def done(self) -> bool:
        return self.reader.done()

    async def _requests(self) -> AsyncIterator[pb.FollowStreamsRequest]:
        while (request := await self._queue.get()) is not None:
            yield request

    def _request(self) -> pb.FollowStreamsRequest:
        """The request going out at the end of this pass of the loop."""
        if self._pending is None:
            self._pending = pb.FollowStreamsRequest()
            asyncio.get_running_loop().call_soon(self._send)
        return self._pending

    def _send(self) -> None:
        request, self._pending = self._pending, None
        if request is not None and not self._half_closed:
            self._queue.put_nowait(request)

    def add(self, follow: Follow) -> None:
        follow._call = self
        self._follows[follow.id] = follow
        self._request().follows.append(follow.request)

    def release(self, follow_id: int) -> None:
        if not self.done():
            self._request().releases.append(follow_id)

    def grant(self, follow_id: int, events: int) -> None:
        if not self.done():
            self._request().grants.add(id=follow_id, events=events)

    def forget(self, follow_id: int) -> None:
        """The follow ended (here or at the service)."""
        self._follows.pop(follow_id, None)
        if self._retired and not self._follows:
            self._half_close()

    def retire(self) -> None:
        """No new follows: the call half-closes once its follows ended."""
        self._retired = True
        if not self._follows:
            self._half_close()

    def _half_close(self) -> None:
        if not self._half_closed:
            self._send()
            self._half_closed = True
            self._queue.put_nowait(None)

    def cancel(self) -> None:
        self._half_close()
        self.call.cancel()

    async def _read(self) -> None:
        err: MeshError = Unavailable("the stream service ended the follow call")
        try:
            async for response in self.call:
                if not response.deliveries or not all(map(_gone, response.deliveries)):
                    self._follower.answered()
                for delivery in response.deliveries:
                    follow = self._follows.get(delivery.id)
                    if follow is not None:
                        follow._deliver(delivery)
        except grpc.aio.AioRpcError as exc:
            cause = from_rpc_error(exc)
            err = Unavailable(f"the follow call to the stream service ended: {cause.message}")
            if cause.reason == "SHUTDOWN":
                err = cause
        except asyncio.CancelledError:
            err = Unavailable("the follow call was cancelled")
        finally:
            self._half_close()
            follows, self._follows = list(self._follows.values()), {}
            if follows:
                self._follower.failed(follows, err)
