"""Many readers of one buffer on one follow: `Fanout.follow(key, ...)` is `Follower.follow` for a
process with many readers of the same buffers (a gateway's browsers). The readers of one key, of one
user and one idle timeout share one upstream follow, which keeps a bounded window of its latest events;
each reader reads that window from its own place. Docs: docs/design/streams.md#shared-follows.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import MeshError, Unavailable
from agentmesh.libs.streams.follower import Follow, FollowCancelled, Follower, acting_user

RECENT = 1024  # events a shared follow keeps for its readers: one further behind reads on its own follow

ShareKey = tuple[str, str, int]  # (reader, key, idle timeout ms)


class SharedFollow:
    """One upstream follow and the latest RECENT events it delivered, numbered from 0 as they came;
    `base` is the offset the kept events follow (a reader that has read up to it, or up to the offset of
    a kept event, reads on from here with nothing missed and nothing twice)."""

    def __init__(self, upstream: Follow, from_offset: str, on_end: Callable[[SharedFollow], None]) -> None:
        self.upstream = upstream
        self.base = from_offset
        self.first = 0  # the number of the oldest event kept
        self.recent: collections.deque[ev.Event] = collections.deque()
        self._after: dict[str, int] = {}  # offset of a kept event -> the number of the one after it
        self.ended = False
        self.error: MeshError | None = None
        self.readers: set[Reader] = set()
        self._waiting: set[Reader] = set()
        self._on_end = on_end
        self._pump = asyncio.get_running_loop().create_task(self._read())

    @property
    def next(self) -> int:
        """The number the next event will have."""
        return self.first + len(self.recent)

    def position_after(self, offset: str) -> int | None:
        """The number of the first event after `offset`, when a reader may start there, else None."""
        if offset == self.base:
            return self.first
        return self._after.get(offset)

    def event(self, number: int) -> ev.Event:
        return self.recent[number - self.first]

    def wait(self, reader: Reader) -> None:
        self._waiting.add(reader)

    def leave(self, reader: Reader) -> None:
        """`reader` reads no more here: the last one to leave ends the upstream follow."""
        self.readers.discard(reader)
        self._waiting.discard(reader)
        if not self.readers and not self.ended:
            self._end()
            self.upstream.cancel()

    async def _read(self) -> None:
        try:
            async for event in self.upstream:
                self.recent.append(event)
                if event.offset:
                    self._after[event.offset] = self.next
                if len(self.recent) > RECENT:
                    gone = self.recent.popleft()
                    self.first += 1
                    if gone.offset:
                        self.base = gone.offset
                        self._after.pop(gone.offset, None)
                self._wake()
        except FollowCancelled:
            pass  # its last reader left
        except MeshError as err:
            self.error = err
        except asyncio.CancelledError:  # the process is closing: no reader is left without an end
            self.error = Unavailable("the shared follow was cancelled")
            raise
        finally:
            self._end()
            self._wake()

    def _end(self) -> None:
        if not self.ended:
            self.ended = True
            self._on_end(self)

    def _wake(self) -> None:
        waiting, self._waiting = self._waiting, set()
        for reader in waiting:
            reader._wake()


class Reader:
    """One reader's follow: its events from its own offset as they come (the last one terminal), or its
    failure raised; the same interface as `Follow`. It reads a shared follow's events, or a follow of
    its own (when it started where no shared follow could serve it, or fell RECENT events behind) until
    it caught up with a shared one."""

    def __init__(self, fanout: Fanout, share: ShareKey, from_offset: str, terminal_only: bool) -> None:
        self._fanout = fanout
        self.share = share
        self.last_offset = from_offset  # of the last event it read
        self._terminal_only = terminal_only
        self._shared: SharedFollow | None = None
        self._position = 0  # the number of the next event to read in `_shared`
        self._own: Follow | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._cancelled = False
        self._done = False

    @property
    def shared(self) -> bool:
        """Reads a shared follow (not one of its own)."""
        return self._shared is not None

    @property
    def ended(self) -> bool:
        return self._done or self._cancelled or (self._own is not None and self._own.ended)

    def __aiter__(self) -> Reader:
        return self

    async def __anext__(self) -> ev.Event:
        while self._shared is not None:
            event = await self._next_shared(self._shared)
            if event is not None:
                return event
        if self._cancelled:
            raise self._cancellation()
        if self._own is None:
            self._done = True
            raise StopAsyncIteration
        event = await self._own.__anext__()
        if event.offset:
            self.last_offset = event.offset
            if not self._terminal_only and not events.is_terminal(event):
                self._catch_up()
        return event

    def _catch_up(self) -> None:
        """On a follow of its own: once its last event is one the shared follow of its key keeps, in
        the newer half of them, it reads on there (so that it does not fall behind again at once)."""
        shared = self._fanout.running(self.share)
        if shared is None or self._own is None:
            return
        position = shared.position_after(self.last_offset)
        if position is not None and position >= shared.next - RECENT // 2:
            self._own.cancel()
            self._own = None
            self._join(shared, position)

    async def _next_shared(self, shared: SharedFollow) -> ev.Event | None:
        """Its next event there; None once it reads there no more (it moved to a follow of its own, or
        the shared follow ended with nothing left for it: then its own stays None)."""
        while True:
            if self._cancelled:
                raise self._cancellation()
            if self._position < shared.first:  # too far behind: its next event is no longer kept
                self._leave(shared)
                self._own = self._fanout.own(self.share, self.last_offset, self._terminal_only)
                return None
            if self._position < shared.next:
                event = shared.event(self._position)
                self._position += 1
                if event.offset:
                    self.last_offset = event.offset
                return event
            if shared.ended:
                self._leave(shared)
                self._done = True
                if shared.error is not None:
                    raise shared.error
                raise StopAsyncIteration
            shared.wait(self)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def cancel(self) -> None:
        """Stops reading (the last reader of a shared follow ends it); a reader waiting gets
        FollowCancelled."""
        if self.ended:
            return
        self._cancelled = True
        if self._shared is not None:
            self._leave(self._shared)
        if self._own is not None:
            self._own.cancel()
        self._wake()

    def _cancellation(self) -> FollowCancelled:
        return FollowCancelled(f"the follow of {self.share[1]} was cancelled")

    def _join(self, shared: SharedFollow, position: int) -> None:
        self._shared = shared
        self._position = position
        shared.readers.add(self)

    def _leave(self, shared: SharedFollow) -> None:
        self._shared = None
        shared.leave(self)

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Fanout:
    """The shared follows of one process, over its `Follower`: a reader joins the shared follow of its
    key, user and idle timeout where that follow kept the events after the reader's offset, else it
    starts one (when none runs) or reads on a follow of its own."""

    def __init__(self, follower: Follower) -> None:
        self._follower = follower
        self._shared: dict[ShareKey, SharedFollow] = {}

    def follow(
        self, key: str, from_offset: str = "", idle_timeout_ms: int = 0, terminal_only: bool = False
    ) -> Reader:
        """Follows `key` after `from_offset` as the user acting now, as `Follower.follow` does."""
        share = (acting_user(), key, idle_timeout_ms)
        reader = Reader(self, share, from_offset, terminal_only)
        if terminal_only:  # nothing to share: the service sends such a follow its last event alone
            reader._own = self.own(share, from_offset, terminal_only)
            return reader
        shared = self._shared.get(share)
        if shared is None:
            shared = SharedFollow(self.own(share, from_offset), from_offset, self._ended)
            self._shared[share] = shared
        position = shared.position_after(from_offset)
        if position is None:
            reader._own = self.own(share, from_offset)
        else:
            reader._join(shared, position)
        return reader

    def own(self, share: ShareKey, from_offset: str, terminal_only: bool = False) -> Follow:
        """A follow of the reader's own, as its user."""
        user, key, idle_timeout_ms = share
        with identity.acting_as(user):
            return self._follower.follow(key, from_offset, idle_timeout_ms, terminal_only)

    def running(self, share: ShareKey) -> SharedFollow | None:
        """The shared follow that takes readers of `share` now."""
        return self._shared.get(share)

    def shared_follows(self) -> int:
        """Shared follows running."""
        return len(self._shared)

    def _ended(self, shared: SharedFollow) -> None:
        """`shared` takes no new readers (it ended, or its last reader left)."""
        for share, running in list(self._shared.items()):
            if running is shared:
                del self._shared[share]
