"""The embedded default backend: buffers in this process's memory.

Offsets are per buffer: its base, the wall clock in nanoseconds when it was made (and above every offset
of the buffer of its key it replaced), plus the event's position in it from 1, formatted as 20 zero-padded
digits: string order = number order. An offset says when its buffer was made and where the event is in
it, never how much any other buffer holds (docs/architecture.md#stream-keys-and-buffers). Storing an
event takes far longer than a nanosecond, so a buffer's offsets stay below the clock, and a buffer made
later, by this process or a restarted one, has a base above every offset of the earlier ones of its key.
Subscribers read the shared buffer by index and wait on a per-buffer wake-up event, so a lagging
subscriber costs an integer, never a queue. Every buffer has a deadline: while open, its lease (`lease_s`
after its last create, append or renewal), after which it is closed with an `interrupted` error; once
closed, `ttl_s` after its close, after which it is gone. Closed buffers are held within two caps
(`max_closed_buffers`, `max_closed_bytes`: their events' serialized size); past either, the oldest
closed ones go first, before their TTL, and read like expired ones (docs/design/streams.md#closed-buffers).
Open buffers are never evicted: `max_events` bounds each.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.config import StreamSettings
from agentmesh.libs.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Shutdown
from agentmesh.libs.ids import shown
from agentmesh.services.stream.backend import (
    SHUTDOWN_READ,
    BackendStats,
    Cursor,
    StreamBackend,
    StreamInfo,
    gap,
    interrupted,
    replaced,
    validate_key,
    written_elsewhere,
)


def format_offset(n: int) -> str:
    return f"{n:020d}"


def parse_offset(offset: str) -> int:
    """ "" -> 0; InvalidArgument unless 1-20 ASCII digits."""
    if not offset:
        return 0
    if len(offset) > 20 or not offset.isascii() or not offset.isdigit():
        raise InvalidArgument(f"invalid offset {shown(offset, 40)}: expected up to 20 digits")
    return int(offset)


@dataclass
class _Buffer:
    key: str
    owner: str
    metadata: dict[str, str]
    expires_at: float  # clock time: open, the end of its lease; closed, when it goes
    # Below every offset of this buffer (its events' are base + 1, base + 2, ...): an offset under it
    # belongs to an earlier buffer of the key (one lost with a restarted process, or closed and
    # replaced), whose reader must not resume here.
    base: int
    events: list[ev.Event] = field(default_factory=list)
    closed: bool = False
    # Readers waiting for the next event, and those waiting for the terminal one alone (each a future,
    # woken by a set_result: no task and no Event per wait).
    waiters: list[asyncio.Future[None]] = field(default_factory=list)
    close_waiters: list[asyncio.Future[None]] = field(default_factory=list)
    # Events held per producer (WriteStreamRequest.producer): a batch sent again is stored once.
    produced: dict[str, int] = field(default_factory=dict)
    size: int = 0  # once closed: the serialized size of its events, what the closed-bytes cap counts

    @property
    def last(self) -> int:
        """The offset of its last event (its base while it has none)."""
        return self.base + len(self.events)

    def push(self, event: ev.Event) -> str:
        stored = ev.Event()
        stored.CopyFrom(event)
        stored.offset = format_offset(self.last + 1)
        self.events.append(stored)
        return stored.offset

    def expire_in(self, now: float, seconds: float) -> None:
        self.expires_at = now + seconds

    def notify(self) -> None:
        waiters, self.waiters = self.waiters, []
        if self.closed:
            waiters += self.close_waiters
            self.close_waiters = []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


class _MemoryCursor(Cursor):
    def __init__(self, buffer: _Buffer, index: int, terminal_only: bool = False) -> None:
        self.buffer = buffer
        self.index = index
        self.terminal_only = terminal_only
        # The idle deadline of the wait under way: one timer per cursor, moved on lazily when it fires
        # early, so a subscriber that gets an event per wait arms no timer per event.
        self._deadline = 0.0
        self._waiting: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def wake_by(self, waiter: asyncio.Future[None], deadline: float) -> None:
        """Resolves `waiter` (with no event: its read comes back empty) at `deadline` at the latest."""
        self._waiting, self._deadline = waiter, deadline
        if self._timer is not None and self._timer.when() > deadline:
            self._timer.cancel()
            self._timer = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiting
        if waiter is None or waiter.done():
            return  # nobody waits: the next wait arms it again
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._expire)
        else:
            waiter.set_result(None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def take(self, limit: int) -> list[ev.Event]:
        """The events ready after the position (advancing it), without waiting; a terminal-only cursor
        skips to the terminal event (none while the buffer is open)."""
        buf = self.buffer
        if self.terminal_only:
            if not buf.closed or self.index >= len(buf.events):
                return []
            self.index = len(buf.events)
            return buf.events[-1:]
        batch = buf.events[self.index : self.index + limit]
        self.index += len(batch)
        return batch

    def waiter(self) -> asyncio.Future[None]:
        """A future the buffer resolves when what this cursor waits for arrives (taken with no await
        since `take` came back empty: no wake-up is lost)."""
        fut = asyncio.get_running_loop().create_future()
        (self.buffer.close_waiters if self.terminal_only else self.buffer.waiters).append(fut)
        return fut

    async def read(self, limit: int, timeout_s: float) -> list[ev.Event]:
        batch = self.take(limit)
        if batch:
            return batch
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.waiter()
        return self.take(limit)


class MemoryBackend(StreamBackend):
    """Buffers in a dict; expired ones are settled lazily on access and by a sweep: an open one whose lease
    ended is closed (interrupted), a closed one past its TTL is dropped."""

    def __init__(
        self,
        settings: StreamSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        super().__init__(settings)
        self.clock = clock  # expiry deadlines; a test passes a clock it moves itself
        self.wall_clock_ns = wall_clock_ns  # the bases of offsets
        self._buffers: dict[str, _Buffer] = {}
        # The closed buffers of `_buffers`, oldest close first, and the sum of their sizes.
        self._closed: OrderedDict[str, _Buffer] = OrderedDict()
        self._closed_bytes = 0
        self._sweeper: asyncio.Task[None] | None = None
        self._waiting: set[asyncio.Future[None]] = set()  # every reader's wait, ended by shutdown

    async def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="stream-expiry-sweep")

    def shutdown(self) -> None:
        super().shutdown()
        for waiter in list(self._waiting):
            if not waiter.done():
                waiter.set_exception(Shutdown(SHUTDOWN_READ))

    async def _read(self, cursor: Cursor, limit: int, timeout_s: float) -> list[ev.Event]:
        """The base class's read, cheaper: events that are there are taken at once, with no await;
        otherwise one future, resolved by the next append (or close), by the cursor's idle timer or by
        shutdown."""
        assert isinstance(cursor, _MemoryCursor)
        batch = cursor.take(limit)
        if batch:
            return batch
        if self._stopping.is_set():
            raise Shutdown(SHUTDOWN_READ)
        waiter = cursor.waiter()
        self._waiting.add(waiter)
        cursor.wake_by(waiter, asyncio.get_running_loop().time() + timeout_s)
        try:
            await waiter
        finally:
            self._waiting.discard(waiter)
        return cursor.take(limit)

    async def aclose(self) -> None:
        await super().aclose()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    def _get(self, key: str) -> _Buffer | None:
        buf = self._buffers.get(key)
        if buf is not None and buf.expires_at <= self.clock():
            if not buf.closed:
                self._end(buf, interrupted())  # its writer died: end it, readers get the terminal event
                self.metrics.interrupted.inc()
                return self._buffers.get(key)  # (unless the closed caps evicted it at once)
            self._forget(key)
            return None
        return buf

    def _end(self, buf: _Buffer, terminal: ev.Event) -> str:
        offset = buf.push(terminal)
        buf.closed = True
        buf.expire_in(self.clock(), self.settings.ttl_s)
        buf.notify()
        self._hold_closed(buf)
        return offset

    def _hold_closed(self, buf: _Buffer) -> None:
        """Counts a buffer just closed among the closed ones held, then evicts the oldest closed while
        either cap is passed (their followers hold the buffer itself and read it to its end). One that
        passes the bytes cap alone is evicted at once, sparing the others."""
        buf.size = sum(event.ByteSize() for event in buf.events)
        self._closed[buf.key] = buf
        if buf.size > self.settings.max_closed_bytes:
            self._closed.move_to_end(buf.key, last=False)  # the first to go, and the only one
        self._closed_bytes += buf.size
        max_buffers, max_bytes = self.settings.max_closed_buffers, self.settings.max_closed_bytes
        while self._closed and (len(self._closed) > max_buffers or self._closed_bytes > max_bytes):
            cap = "bytes" if self._closed_bytes > max_bytes else "buffers"
            key, oldest = next(iter(self._closed.items()))
            self._forget(key)
            self.metrics.evicted.labels(cap).inc()
            self.metrics.evicted_bytes.inc(oldest.size)

    def _forget(self, key: str) -> None:
        """Drops the buffer of `key` (expired, evicted, deleted or replaced)."""
        buf = self._buffers.pop(key, None)
        if buf is not None and self._closed.pop(key, None) is not None:
            self._closed_bytes -= buf.size

    def sweep(self) -> int:
        """Settles expired buffers (ends open ones whose lease ended, drops closed ones past their TTL);
        returns how many it touched."""
        expired = [k for k, b in self._buffers.items() if b.expires_at <= self.clock()]
        for key in expired:
            self._get(key)
        return len(expired)

    async def _sweep_forever(self) -> None:
        interval = min(max(min(self.settings.ttl_s, self.settings.lease_s) / 4, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            self.sweep()

    async def create(self, key: str, owner: str, metadata: dict[str, str] | None = None) -> None:
        validate_key(key)
        old = self._get(key)  # an abandoned open buffer has expired: None
        if old is not None and not old.closed:
            raise FailedPrecondition(f"a run is already streaming to {key}")
        if old is not None and old.owner != owner:
            raise FailedPrecondition(f"{key} holds another user's buffer")
        base = max(self.wall_clock_ns(), old.last + 1 if old is not None else 0)
        self._forget(key)
        self._buffers[key] = _Buffer(
            key=key,
            owner=owner,
            metadata=dict(metadata or {}),
            expires_at=self.clock() + self.settings.lease_s,
            base=base,
        )

    def _writable(self, key: str, writer: str, since: str) -> _Buffer:
        buf = self._get(validate_key(key))
        if buf is None and since:
            raise written_elsewhere(key, since)
        if buf is None or (writer and writer != buf.owner):
            raise NotFound(f"no stream buffer {key}")
        if since and parse_offset(since) < buf.base:
            raise written_elsewhere(key, since)
        return buf

    async def append(
        self,
        key: str,
        batch: Sequence[ev.Event],
        writer: str = "",
        since: str = "",
        producer: str = "",
        sequence: int = 0,
    ) -> list[str]:
        buf = self._writable(key, writer, since)
        if buf.closed:
            raise FailedPrecondition(f"stream {key} is closed")
        buf.expire_in(self.clock(), self.settings.lease_s)  # its writer is alive
        held = 0
        if producer:
            held = buf.produced.get(producer, 0) - sequence
            if held < 0:
                raise gap(key, sequence, buf.produced.get(producer, 0))
        if len(buf.events) + len(batch) - held > self.settings.max_events:
            raise ResourceExhausted(
                f"stream {key} is full: {len(buf.events)} events, appending {len(batch)} would pass "
                f"the cap of {self.settings.max_events}"
            )
        offsets = [""] * min(held, len(batch)) + [buf.push(event) for event in batch[held:]]
        if producer:
            buf.produced[producer] = max(buf.produced.get(producer, 0), sequence + len(batch))
        if len(batch) > held:
            buf.notify()
            self.metrics.appended_to(key, len(batch) - held)
        return offsets

    async def close(
        self, key: str, terminal: ev.Event, writer: str = "", since: str = ""
    ) -> tuple[str, bool]:
        buf = self._writable(key, writer, since)
        if buf.closed:
            return buf.events[-1].offset, False
        return self._end(buf, terminal), True

    async def renew(self, keys: Sequence[str]) -> int:
        renewed = 0
        for key in keys:
            buf = self._get(validate_key(key))
            if buf is not None and not buf.closed:
                buf.expire_in(self.clock(), self.settings.lease_s)
                renewed += 1
        return renewed

    async def delete(self, key: str, terminal: ev.Event, requester: str = "") -> bool:
        buf = self._get(validate_key(key))
        if buf is None or (requester and requester != buf.owner):
            return False
        if not buf.closed:
            self._end(buf, terminal)
        self._forget(key)  # followers hold the buffer itself and read it to its end
        return True

    async def info(self, key: str) -> StreamInfo:
        buf = self._get(validate_key(key))
        if buf is None:
            return StreamInfo(key=key)
        return StreamInfo(
            key=key,
            exists=True,
            closed=buf.closed,
            last_offset=buf.events[-1].offset if buf.events else "",
            owner=buf.owner,
            metadata=dict(buf.metadata),
            length=len(buf.events),
        )

    async def _cursor(self, key: str, after: str, terminal_only: bool = False) -> Cursor | None:
        buf = self._get(key)
        if buf is None:
            raise NotFound(f"no stream buffer {key}")
        position = parse_offset(after)
        if 0 < position < buf.base:
            raise replaced(key, after)
        index = min(max(position - buf.base, 0), len(buf.events))  # of the first event after it
        if buf.closed and index >= len(buf.events):
            return None
        return _MemoryCursor(buf, index, terminal_only)

    async def open_buffers(self) -> int:
        return len(self._buffers) - len(self._closed)

    async def refresh_metrics(self) -> None:
        await super().refresh_metrics()
        self.metrics.closed_buffers.set(len(self._closed))
        self.metrics.closed_bytes.set(self._closed_bytes)

    def stats(self) -> BackendStats:
        return BackendStats(
            buffers=len(self._buffers),
            events=sum(len(b.events) for b in self._buffers.values()),
            subscribers=self._subscribers,
            max_batch_held=self._max_batch,
            closed_buffers=len(self._closed),
            closed_bytes=self._closed_bytes,
        )
