"""Many follows on one FollowStreams call: `Follower.follow(key, ...)` reads one buffer as an async
iterator of events (the protocol: docs/design/streams.md)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import Cancelled, MeshError, Unavailable, from_reason, from_rpc_error
from agentmesh.libs.identity import Signer
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc

WINDOW = 256  # events the service may send a follow beyond what its reader consumed


class FollowCancelled(Cancelled):
    """The follow was ended by its own reader (`Follow.cancel()`)."""


def acting_token(signer: Signer) -> str:
    """A token of the user acting now, for an item of a call opened as the mesh ("": the mesh itself)."""
    principal = identity.current()
    if principal is None or principal.is_mesh:
        return ""
    return signer.mint(principal.user)


class Follow:
    """One follow: its events as they come (the last one terminal), or its failure raised."""

    def __init__(self, follower: Follower, request: pb.StreamFollow) -> None:
        self._follower = follower
        self.request = request
        self.id = request.id
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
        if delivery.ended:
            failed = delivery.error_reason
            self._end(from_reason(failed, delivery.error_message) if failed else None)
        else:
            self._wake()

    def _end(self, err: MeshError | None) -> None:
        self._ended = True
        self._error = err
        if self._call is not None:
            self._call.forget(self.id)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Follower:
    """The follows of one process, on one FollowStreams call at a time (a call lives half the streaming
    deadline, then new follows go on a new one while the old one ends with its last follow)."""

    def __init__(
        self, stub: Callable[[], stream_service_pb2_grpc.StreamServiceStub], signer: Signer, life_s: float
    ) -> None:
        self._stub = stub
        self._signer = signer
        self._life_s = life_s
        self._ids = itertools.count(1)
        self._call: _FollowCall | None = None
        self._calls: set[_FollowCall] = set()

    def follow(
        self, key: str, from_offset: str = "", idle_timeout_ms: int = 0, terminal_only: bool = False
    ) -> Follow:
        """Follows `key` after `from_offset` as the user acting now (started at once: a caller may start
        it before it reads)."""
        request = pb.StreamFollow(
            id=next(self._ids),
            subscription=pb.SubscribeStreamRequest(
                key=key, from_offset=from_offset, idle_timeout_ms=idle_timeout_ms, terminal_only=terminal_only
            ),
            identity=acting_token(self._signer),
            window=WINDOW,
        )
        follow = Follow(self, request)
        self._current().add(follow)
        return follow

    def _current(self) -> _FollowCall:
        call = self._call
        loop = asyncio.get_running_loop()
        if call is None or call.done() or loop.time() - call.opened > self._life_s:
            if call is not None:
                call.retire()
            with identity.acting_as(""):  # the call is the mesh's; each follow carries its reader
                call = self._call = _FollowCall(self._stub().FollowStreams, self._calls.discard)
            self._calls.add(call)
        return call

    async def aclose(self) -> None:
        """Ends every call (their follows raise Unavailable)."""
        self._call = None
        calls, self._calls = list(self._calls), set()
        for call in calls:
            call.cancel()
        for call in calls:
            with contextlib.suppress(BaseException):
                await call.reader


class _FollowCall:
    """One FollowStreams call: requests gathered in one pass of the loop go as one message; a task
    reads the deliveries and hands them to their follows."""

    def __init__(self, method: Any, on_done: Callable[[_FollowCall], None]) -> None:
        loop = asyncio.get_running_loop()
        self.opened = loop.time()
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
            for follow in list(self._follows.values()):
                follow._end(err)
            self._follows.clear()
