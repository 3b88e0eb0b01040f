"""The stream buffer domain: keys, the abstract backend, and the subscribe loop both backends share.

A buffer is an append-only list of `Event`s under a key (`trace:<id>`, `a2a:<task id>`,
`subagent:<id>`, `push:<id>`), with an owner, free metadata and a closed flag. Every appended event
gets an offset, strictly increasing per key and never reused. Closing appends the terminal event
(`done` or `error`). Subscribers replay everything after an offset, then follow live until the terminal event.
A closed buffer expires `ttl_s` after its close. An open buffer holds a lease of `lease_s`, renewed by every
append and by `renew` (its writers renew it while they run): an open buffer whose lease expired was
abandoned by a writer that died, and is closed with an `interrupted` error, so every reader still gets
a terminal event; like any closed buffer it may then be replaced by CreateStream.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.config import StreamSettings
from agentmesh.libs.errors import (
    FailedPrecondition,
    IdleTimeout,
    Interrupted,
    InvalidArgument,
    NotFound,
    Shutdown,
)
from agentmesh.libs.events import is_terminal
from agentmesh.libs.ids import parse_stream_key, shown
from agentmesh.libs.metrics import StreamMetrics

BATCH = 256  # events a subscriber reads (and holds) at once

T = TypeVar("T")


@functools.lru_cache(maxsize=10_000)  # every append names its key: a regex match each was 4 % of the service
def validate_key(key: str) -> str:
    """Returns the key, or raises InvalidArgument unless it is `trace|a2a|subagent|push:<id>`."""
    parse_stream_key(key)
    return key


def coalesce(batch: Sequence[ev.Event]) -> list[ev.Event]:
    """Merges runs of consecutive `text_delta` events into one (text joined, last offset kept).

    Nothing else is merged, dropped or reordered.
    """
    out: list[ev.Event] = []
    run: list[ev.Event] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            merged = events.text_delta("".join(e.text_delta.text_delta for e in run))
            merged.offset = run[-1].offset
            out.append(merged)
        run.clear()

    for event in batch:
        if events.kind(event) == "text_delta":
            run.append(event)
        else:
            flush()
            out.append(event)
    flush()
    return out


@dataclass
class StreamInfo:
    """Facts about one buffer."""

    key: str
    exists: bool = False
    closed: bool = False
    last_offset: str = ""
    owner: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    length: int = 0


@dataclass
class BackendStats:
    """Internal sizes, for tests and metrics: nothing here grows with a subscriber's lag."""

    buffers: int = 0
    events: int = 0
    subscribers: int = 0
    max_batch_held: int = 0  # the most events any subscriber held at once since start
    closed_buffers: int = 0  # memory: the closed buffers held until their TTL (within its caps)
    closed_bytes: int = 0  # memory: their events' serialized size


class Cursor(abc.ABC):
    """One subscriber's read position in one buffer."""

    @abc.abstractmethod
    async def read(self, limit: int, timeout_s: float) -> list[ev.Event]:
        """Up to `limit` events after the position (advancing it); [] after `timeout_s` without any."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases what the cursor holds (timers); the subscription ended."""


def replaced(key: str, offset: str) -> NotFound:
    """A read after an offset of an earlier buffer of `key` than the one the key holds: the buffer meant
    is gone (closed and replaced by a newer turn's, or lost with a restarted in-memory service), and
    the newer one is not its continuation."""
    return NotFound(f"offset {shown(offset, 40)} is from an earlier buffer of {key}, which is gone")


def written_elsewhere(key: str, since: str) -> Interrupted:
    """A write naming (`since`) an earlier buffer of `key` than the one the key holds: its writer's turn
    lost its buffer (as `replaced` says), and the newer one is another turn's: nothing is written."""
    return Interrupted(
        f"the buffer of {key} this write was for (offset {shown(since, 40)}) is gone: its stream service "
        "restarted, or a newer buffer of the key replaced it; nothing was written"
    )


def gap(key: str, sequence: int, held: int) -> FailedPrecondition:
    """A producer's batch starting past the events the buffer holds from it: some were never stored."""
    return FailedPrecondition(
        f"a batch for {key} starts at event {sequence} of its producer, but the buffer holds {held} of "
        "its events: the ones between were never stored"
    )


SHUTDOWN_READ = "stream service is shutting down; resume from the last offset"
SHUTDOWN_WRITE = "stream service is shutting down; write to another replica"


class StreamBackend(abc.ABC):
    """Live buffers by key. Subclasses store them; this class owns validation and the subscribe loop."""

    def __init__(self, settings: StreamSettings | None = None, metrics: StreamMetrics | None = None) -> None:
        self.settings = settings or StreamSettings()
        self.metrics = metrics or StreamMetrics()  # the stream server gives its registry's
        self._stopping = asyncio.Event()
        # Tasks waiting for a call's next request, or for a follow's next events (`_stoppable`).
        self._waiting_tasks: set[asyncio.Task[Any]] = set()
        self._subscribers = 0
        self._max_batch = 0

    # --- storage, implemented by each backend -------------------------------------------------------

    @abc.abstractmethod
    async def create(self, key: str, owner: str, metadata: dict[str, str] | None = None) -> None:
        """Creates the buffer, or replaces a closed or abandoned one of the same owner;
        FailedPrecondition while one is open or when the key holds another user's buffer."""

    @abc.abstractmethod
    async def append(
        self,
        key: str,
        batch: Sequence[ev.Event],
        writer: str = "",
        since: str = "",
        producer: str = "",
        sequence: int = 0,
    ) -> list[str]:
        """Appends to an open buffer (renewing its lease), returns one offset per event.

        With a `producer`, `sequence` is the index of the batch's first event among the producer's
        events in this buffer: the events the buffer already holds from it are skipped (their offsets
        are ""), so a batch sent again is stored once (WriteStreamRequest.producer); a sequence past
        them is a gap (FailedPrecondition).

        NotFound (no buffer, or a `writer` who is not its owner; "" is the mesh itself), Interrupted
        (`since`, an offset of the buffer meant, is an earlier buffer's, or that buffer is gone:
        `written_elsewhere`), FailedPrecondition (closed; a gap), ResourceExhausted (over max_events).
        """

    @abc.abstractmethod
    async def close(
        self, key: str, terminal: ev.Event, writer: str = "", since: str = ""
    ) -> tuple[str, bool]:
        """Appends the terminal event and closes: (its offset, True); (terminal offset, False) if closed.
        NotFound as for append."""

    async def end(
        self, key: str, batch: Sequence[ev.Event], terminal: ev.Event, writer: str = "", since: str = ""
    ) -> tuple[list[str], str, bool]:
        """Appends `batch` (none terminal), then closes with `terminal`: (the batch's offsets, the
        terminal's offset, closed). Append's errors when there is a batch (a closed buffer:
        FailedPrecondition, nothing appended); without one, as `close`."""
        offsets = await self.append(key, batch, writer, since) if batch else []
        offset, closed = await self.close(key, terminal, writer, since)
        return offsets, offset, closed

    @abc.abstractmethod
    async def renew(self, keys: Sequence[str]) -> int:
        """Renews the leases of the open buffers among `keys`; returns how many."""

    @abc.abstractmethod
    async def delete(self, key: str, terminal: ev.Event, requester: str = "") -> bool:
        """Ends the buffer for good: closes it with `terminal` when it is open, and makes the key read
        like a missing one at once (subscribers already following still get the terminal event).
        False when there is no buffer, or it is not `requester`'s ("" is the mesh itself)."""

    @abc.abstractmethod
    async def info(self, key: str) -> StreamInfo:
        """Facts about the buffer; `exists=False` for an unknown or expired key."""

    @abc.abstractmethod
    async def _cursor(self, key: str, after: str, terminal_only: bool = False) -> Cursor | None:
        """A read position after `after` ("" = start); None when the buffer is closed and read to its end.
        `terminal_only`: the reader wants the terminal event alone (the cursor may skip the rest)."""

    @abc.abstractmethod
    def stats(self) -> BackendStats: ...

    @abc.abstractmethod
    async def open_buffers(self) -> int:
        """How many buffers are open (memory: in this process; Redis: in every replica, by lease)."""

    async def refresh_metrics(self) -> None:
        """Before a scrape: the gauges that are read, not counted."""
        self.metrics.buffers_open.set(await self.open_buffers())

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Starts background work (expiry sweeps, closing buffers whose lease expired)."""

    async def aclose(self) -> None:
        """Ends subscriptions and releases connections."""
        self.shutdown()

    # --- shared behaviour ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Ends every subscription and write stream promptly (UNAVAILABLE: resume elsewhere) and refuses
        new ones."""
        self._stopping.set()
        for task in self._waiting_tasks:
            task.cancel()

    @property
    def subscribers(self) -> int:
        return self._subscribers

    async def read_info(self, key: str, reader: str = "") -> StreamInfo:
        """`info`, but a reader other than the owner sees nothing (as for an unknown key)."""
        found = await self.info(validate_key(key))
        if found.exists and reader and reader != found.owner:
            return StreamInfo(key=key)
        return found

    async def subscribe(
        self,
        key: str,
        from_offset: str = "",
        reader: str = "",
        idle_timeout_ms: int = 0,
        terminal_only: bool = False,
    ) -> AsyncGenerator[ev.Event, None]:
        """Replays the events after `from_offset`, then follows live; the last one is `done` or `error`.
        `terminal_only`: that last event alone (a backend may skip reading the others at all).

        NotFound for an unknown key or a reader who is not the owner. Without any event for the idle
        timeout it ends with an `error` event (code idle_timeout, no offset).
        """
        if idle_timeout_ms < 0:
            raise InvalidArgument("idle_timeout_ms must be >= 0 (0: the server default)")
        found = await self.read_info(key, reader)
        if not found.exists:
            raise NotFound(f"no stream buffer {key}")
        if self._stopping.is_set():
            raise Shutdown(SHUTDOWN_READ)
        idle_s = (idle_timeout_ms or self.settings.idle_timeout_ms) / 1000
        cursor = await self._cursor(key, from_offset, terminal_only)
        if cursor is None:
            return
        loop = asyncio.get_running_loop()
        self._subscribers += 1
        self.metrics.subscribers.inc()
        try:
            deadline = loop.time() + idle_s
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    yield events.error(IdleTimeout(f"no event on {key} for {idle_s:g}s"))
                    return
                batch = await self._read(cursor, BATCH, remaining)
                if not batch:
                    continue
                self._max_batch = max(self._max_batch, len(batch))
                deadline = loop.time() + idle_s
                merged = coalesce(batch)
                if len(merged) < len(batch):
                    self.metrics.coalesced.inc(len(batch) - len(merged))
                for event in merged:
                    if terminal_only and not is_terminal(event):
                        continue
                    yield event
                    if is_terminal(event):
                        return
        finally:
            cursor.close()
            self._subscribers -= 1
            self.metrics.subscribers.dec()

    async def until_shutdown(self, items: AsyncIterable[T]) -> AsyncGenerator[T, None]:
        """The items of `items` (a writer's batches) until it ends; Shutdown once the service stops while
        waiting for the next one. An item is either yielded or, when Shutdown is raised, never taken: a
        writer told to shut down may send the batch it has no answer for again, elsewhere.

        The wait runs in the caller's task (no task per item): shutdown cancels the tasks that wait, and
        the cancellation comes out here as Shutdown.
        """
        source = aiter(items)
        while True:
            with self._stoppable(SHUTDOWN_WRITE):
                try:
                    item = await anext(source)
                except StopAsyncIteration:
                    return
            yield item

    async def _read(self, cursor: Cursor, limit: int, timeout_s: float) -> list[ev.Event]:
        """The cursor's next events, read in the caller's task (no task per read); Shutdown when the
        service stops first. (A backend may do it cheaper still.)"""
        with self._stoppable(SHUTDOWN_READ):
            return await cursor.read(limit, timeout_s)

    @contextlib.contextmanager
    def _stoppable(self, message: str) -> Iterator[None]:
        """What the body awaits ends with Shutdown(message) once the service stops: `shutdown` cancels
        the tasks waiting in here, and the cancellation comes out as Shutdown (a cancellation of the
        task for any other reason stays one)."""
        if self._stopping.is_set():
            raise Shutdown(message)
        task = asyncio.current_task()
        assert task is not None
        self._waiting_tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if self._stopping.is_set() and task.uncancel() == 0:
                raise Shutdown(message) from None
            raise
        finally:
            self._waiting_tasks.discard(task)


def interrupted() -> ev.Event:
    """The terminal event of a buffer whose writer stopped renewing its lease."""
    return events.error(Interrupted("the run writing this stream stopped; resume is not possible"))
