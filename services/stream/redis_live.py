"""Every live follow of one stream service on Redis, read by one `XREAD BLOCK` (docs/design/streams.md,
"The service side"): a follow that has replayed its buffer joins, and the one read loop hands each entry
it fetches to every follow of that buffer that is behind it. One blocking connection and one round trip
per batch of entries, whatever the number of live follows, instead of one of each per follow.

The loop reads each buffer from the lowest position of its follows that have room (a follow holds at
most `HELD` entries it was given and did not take: past that it is left out until its reader takes
them). A follow that joins while the loop waits in Redis wakes it with an entry in the process's own
wake stream, which the loop reads beside the buffers. When Redis fails, every follow gets the error."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import secrets
from typing import Any

import redis.asyncio as aioredis

log = logging.getLogger(__name__)

BLOCK_MS = 2_000  # one XREAD BLOCK stays below the client's socket timeout (redis-py: 5 s)
COUNT = 256  # entries per buffer per read
HELD = 1_024  # entries a follow holds before it is left out of the reads until its reader takes them
WAKE_TTL_MS = 60_000


def _id(entry_id: Any) -> tuple[int, int]:
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


class LiveFollow:
    """One live follow's entries as the loop hands them over."""

    def __init__(self, stream: str, after: str) -> None:
        self.stream = stream
        self.after = after or "0-0"  # the id of the last entry given to it (or where it joined)
        self.entries: collections.deque[Any] = collections.deque()
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    @property
    def full(self) -> bool:
        return len(self.entries) >= HELD

    def take(self, limit: int) -> list[Any]:
        out = [self.entries.popleft() for _ in range(min(limit, len(self.entries)))]
        if not self.entries:
            self.ready.clear()
        return out


class LiveReads:
    def __init__(self, client: aioredis.Redis, prefix: str) -> None:
        self.client = client
        self.wake_key = f"{prefix}wake:{secrets.token_hex(8)}"
        self.follows: dict[str, set[LiveFollow]] = {}
        self._task: asyncio.Task[None] | None = None
        self._reading: dict[str, tuple[int, int]] | None = None  # what the read under way asked for
        self._wake_after = "0-0"
        self._wakes: set[asyncio.Task[None]] = set()

    def join(self, follow: LiveFollow) -> None:
        self.follows.setdefault(follow.stream, set()).add(follow)
        self.resume(follow)
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="stream-redis-live-reads")

    def resume(self, follow: LiveFollow) -> None:
        """`follow` has room (again): the read under way wakes when it did not ask for its entries."""
        reading = self._reading
        if reading is None or follow.full:
            return
        at = reading.get(follow.stream)
        if at is None or _id(follow.after) < at:
            self._reading = None  # one wake per read
            task = asyncio.create_task(self._wake())
            self._wakes.add(task)
            task.add_done_callback(self._wakes.discard)

    def leave(self, follow: LiveFollow) -> None:
        same = self.follows.get(follow.stream)
        if same is not None:
            same.discard(follow)
            if not same:
                del self.follows[follow.stream]

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        with contextlib.suppress(aioredis.RedisError, OSError):
            await self.client.delete(self.wake_key)

    async def _wake(self) -> None:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_key, {"w": b"1"}, maxlen=16, approximate=True)
                pipe.pexpire(self.wake_key, WAKE_TTL_MS)
                await pipe.execute()
        except (aioredis.RedisError, OSError) as exc:  # the read fails too, and says why to its follows
            log.debug("could not wake the live reads: %s", exc)

    def _positions(self) -> dict[str, str]:
        """Each buffer's read position: the lowest of its follows with room."""
        out: dict[str, str] = {}
        for stream, follows in self.follows.items():
            open_ = [f.after for f in follows if not f.full]
            if open_:
                out[stream] = min(open_, key=_id)
        return out

    async def _loop(self) -> None:
        try:
            while self.follows:
                positions = self._positions()
                self._reading = {s: _id(p) for s, p in positions.items()}
                try:
                    streams: dict[Any, Any] = {**positions, self.wake_key: self._wake_after}
                    reply = await self.client.xread(streams, count=COUNT, block=BLOCK_MS)
                except Exception as exc:  # whatever fails the read ends every follow with it
                    self._fail(exc)
                    continue
                finally:
                    self._reading = None
                self._hand_out(reply)
        finally:
            self._task = None

    def _hand_out(self, reply: Any) -> None:
        if not reply:
            return
        items = reply.items() if isinstance(reply, dict) else ((s, [e]) for s, e in reply)  # RESP3 | RESP2
        for stream, batches in items:
            name = stream.decode() if isinstance(stream, bytes) else str(stream)
            entries = batches[0] if batches else []
            if name == self.wake_key:
                if entries:
                    self._wake_after = entries[-1][0].decode()
                continue
            for follow in self.follows.get(name, ()):
                if follow.full:
                    continue
                after = _id(follow.after)
                new = [e for e in entries if _id(e[0]) > after]
                if new:
                    follow.entries.extend(new)
                    follow.after = new[-1][0].decode()
                    follow.ready.set()

    def _fail(self, exc: BaseException) -> None:
        """The read failed (Redis away, or anything else): every follow gets the error and leaves (its
        reader raises it, and its subscription ends with it)."""
        for follows in self.follows.values():
            for follow in follows:
                follow.error = exc
                follow.ready.set()
        self.follows.clear()
