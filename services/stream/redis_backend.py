"""The shared backend: Redis Streams, so any number of stream-service replicas serve the same keys.

Per buffer two keys: `<prefix>stream:<key>` (a Redis Stream; field `e` = the serialized Event, `g` = the
gen of the buffer that wrote it; the entry id IS the offset) and `<prefix>meta:<key>` (a hash: owner,
metadata as JSON, closed, close_offset, gen: a random token per create, so a subscriber tells its buffer
from a later one under the key without asking the meta, and begin: the server's time at the create as an
entry id, or just above the replaced buffer's last entry when that came in the same millisecond, below
which no offset is this buffer's). Create, append, close, renew and delete are Lua
scripts, so the checks and the writes are atomic across replicas. Replacing a closed buffer trims its
stream to zero entries instead of deleting it: Redis keeps the last id, so new offsets stay above every
old one. Both keys always carry a TTL of `ttl_s`, refreshed by every write. The leases of open buffers
are one sorted set, `<prefix>leases` (score: the deadline in Redis server time); every replica sweeps it
and ends the buffers whose writer died.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
from collections.abc import Iterator, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.config import StreamSettings
from agentmesh.libs.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from agentmesh.libs.ids import shown
from agentmesh.services.stream import redis_scripts as scripts
from agentmesh.services.stream.backend import (
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
from agentmesh.services.stream.redis_batch import ScriptBatch
from agentmesh.services.stream.redis_live import LiveFollow, LiveReads

log = logging.getLogger(__name__)
DEFAULT_PREFIX = "agentmesh:"
_OFFSET = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")
_U64 = 2**64 - 1


@contextlib.contextmanager
def _reachable() -> Iterator[None]:
    """Redis gone, refusing or too slow (redis-py's own errors) is UNAVAILABLE, the caller may try again
    later, never INTERNAL."""
    try:
        yield
    except (RedisConnectionError, RedisTimeoutError) as exc:
        raise Unavailable(f"Redis is unreachable: {exc}") from exc


DRAIN_MS = 10_000


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_tuple(offset: str) -> tuple[int, int]:
    ms, _, seq = offset.partition("-")
    return int(ms), int(seq or 0)


def _padded(offset: str) -> str:
    """An entry id as scripts.SINCE compares it (40 digits); "" stays ""."""
    if not check_offset(offset):
        return ""
    ms, seq = _id_tuple(offset)
    return f"{ms:020d}{seq:020d}"


def check_offset(offset: str) -> str:
    """The offset when it is empty or an entry id Redis accepts as an exclusive start; InvalidArgument
    otherwise (Redis itself refuses parts above 2^64-1, and an exclusive start at the largest id, with
    an error that would surface as INTERNAL)."""
    if offset and not _OFFSET.fullmatch(offset):
        raise InvalidArgument(
            f"invalid offset {shown(offset, 40)}: expected a Redis entry id like 1700000000000-0"
        )
    if offset and (max(_id_tuple(offset)) > _U64 or offset == f"{_U64}-{_U64}"):
        raise InvalidArgument(f"invalid offset {offset!r}: out of the range of Redis entry ids")
    return offset


def _decode(entry_id: Any, fields: dict[Any, Any]) -> ev.Event:
    event = ev.Event.FromString(fields[b"e"])
    event.offset = _s(entry_id)
    return event


class _RedisCursor(Cursor):
    """XRANGE (exclusive start) while replaying, then live: a follow of the process's one XREAD BLOCK
    (redis_live.py); COUNT bounds every batch.

    It follows one buffer, not its key: entries read after the buffer was replaced (its `gen` changed:
    an abandoned buffer expired and CreateStream made a new one, maybe another user's) end the reading,
    and the subscription idles out as it does on a memory buffer nobody writes to any more.
    """

    def __init__(
        self, client: aioredis.Redis, live: LiveReads, stream: str, after: str, meta: str, gen: Any
    ) -> None:
        self.client = client
        self.live_reads = live
        self.stream = stream
        self.last = after
        self.live: LiveFollow | None = None
        self.meta = meta
        self.gen = gen
        self.replaced = False

    async def read(self, limit: int, timeout_s: float) -> list[ev.Event]:
        with _reachable():
            return await self._read(limit, timeout_s)

    async def _read(self, limit: int, timeout_s: float) -> list[ev.Event]:
        if self.replaced:
            await asyncio.sleep(timeout_s)
            return []
        live = self.live
        if live is None:
            start = f"({self.last}" if self.last else "-"
            entries = await self.client.xrange(self.stream, min=start, max="+", count=limit)
            if entries:
                return await self._checked(entries)
            live = self.live = LiveFollow(self.stream, self.last)
            self.live_reads.join(live)
        if not live.entries and live.error is None:
            try:
                async with asyncio.timeout(timeout_s):
                    await live.ready.wait()
            except TimeoutError:
                return []
        if live.error is not None:
            raise live.error
        was_full = live.full
        entries = live.take(limit)
        if was_full:
            self.live_reads.resume(live)
        return await self._checked(entries)

    def close(self) -> None:
        if self.live is not None:
            self.live_reads.leave(self.live)
            self.live = None

    async def _checked(self, entries: list[Any]) -> list[ev.Event]:
        """The entries, unless they are another buffer's (then none, ever again): each names the gen of
        the buffer that wrote it (an entry without one, of an older version's script, asks the meta)."""
        gens = {fields.get(b"g") for _, fields in entries}
        if None in gens:
            gens.discard(None)
            gens.add(await self.client.hget(self.meta, "gen"))
        if gens != {self.gen}:
            self.replaced = True
            self.close()  # nothing more of this key is its buffer's
            return []
        return self._advance(entries)

    def _advance(self, entries: list[Any]) -> list[ev.Event]:
        batch = [_decode(entry_id, fields) for entry_id, fields in entries]
        self.last = batch[-1].offset
        return batch


class RedisBackend(StreamBackend):
    """Buffers in Redis Streams, shared by every replica that uses the same URL and prefix."""

    def __init__(
        self,
        url: str,
        settings: StreamSettings | None = None,
        prefix: str = DEFAULT_PREFIX,
        client: aioredis.Redis | None = None,
    ) -> None:
        super().__init__(settings)
        self.prefix = prefix
        # Commands wait for a free connection of the pool (up to the socket timeout) instead of failing
        # a burst; the live follows take one between them (redis_live.py).
        self.client = client or aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(
                url, max_connections=self.settings.redis_max_connections, timeout=5.0
            )
        )
        self._create = self.client.register_script(scripts.CREATE)
        # The appends of many writers at once share a round trip (redis_batch.py).
        self._append = ScriptBatch(self.client, self.client.register_script(scripts.APPEND))
        self._close = self.client.register_script(scripts.CLOSE)
        self._delete = self.client.register_script(scripts.DELETE)
        self._renew = self.client.register_script(scripts.RENEW)
        self._sweep = self.client.register_script(scripts.SWEEP)
        self._leases = f"{prefix}leases"
        self._sweeper: asyncio.Task[None] | None = None
        self._live = LiveReads(self.client, prefix)

    def _keys(self, key: str) -> list[str]:
        return [f"{self.prefix}meta:{key}", f"{self.prefix}stream:{key}", self._leases]

    def _ttl_ms(self) -> int:
        """The TTL of a closed buffer's keys."""
        return max(1, int(self.settings.ttl_s * 1000))

    def _open_ttl_ms(self) -> int:
        """The TTL of an open buffer's keys: a safety net well past its lease (the sweep ends it first)."""
        return max(self._ttl_ms(), 4 * self._lease_ms())

    def _lease_ms(self) -> int:
        return max(1, int(self.settings.lease_s * 1000))

    async def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep_forever(), name="stream-lease-sweep")

    async def sweep(self, limit: int = 100) -> list[str]:
        """Ends the open buffers whose lease expired; returns their keys."""
        args: list[Any] = [self.prefix, limit, interrupted().SerializeToString(), self._ttl_ms()]
        ended = [_s(k) for k in await self._sweep(keys=[self._leases], args=args)]
        if ended:
            self.metrics.interrupted.inc(len(ended))
        return ended

    async def _sweep_forever(self) -> None:
        interval = min(max(self.settings.lease_s / 4, 0.05), 10.0)
        while True:
            await asyncio.sleep(interval)
            try:
                while len(await self.sweep()) == 100:
                    pass
            except aioredis.RedisError as exc:  # Redis away for a moment: the next round retries
                log.warning("lease sweep failed: %s", exc)

    async def aclose(self) -> None:
        await super().aclose()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self._live.aclose()
        await self._append.aclose()
        await self.client.aclose()

    async def create(self, key: str, owner: str, metadata: dict[str, str] | None = None) -> None:
        keys = self._keys(validate_key(key))
        gen = secrets.token_hex(8)
        args: list[Any] = [owner, json.dumps(metadata or {}), self._ttl_ms(), gen, self._lease_ms(), key]
        with _reachable():
            result = await self._create(keys=keys, args=args)
        if _s(result) == "open":
            raise FailedPrecondition(f"a run is already streaming to {key}")
        if _s(result) == "foreign":
            raise FailedPrecondition(f"{key} holds another user's buffer")

    async def append(
        self,
        key: str,
        batch: Sequence[ev.Event],
        writer: str = "",
        since: str = "",
        producer: str = "",
        sequence: int = 0,
    ) -> list[str]:
        keys = self._keys(validate_key(key))
        payloads = [e.SerializeToString() for e in batch]
        args = [
            self.settings.max_events,
            self._open_ttl_ms(),
            writer,
            self._lease_ms(),
            key,
            _padded(since),
            producer,
            sequence,
            *payloads,
        ]
        with _reachable():
            reply = [_s(x) for x in await self._append(keys=keys, args=args)]
        status = reply[0]
        if status == "missing":
            raise NotFound(f"no stream buffer {key}")
        if status == "replaced":
            raise written_elsewhere(key, since)
        if status == "closed":
            raise FailedPrecondition(f"stream {key} is closed")
        if status == "gap":
            raise gap(key, sequence, int(reply[1]))
        if status == "full":
            raise ResourceExhausted(
                f"stream {key} is full: {reply[1]} events, appending {len(batch)} would pass "
                f"the cap of {self.settings.max_events}"
            )
        offsets = reply[1:]
        self.metrics.appended_to(key, sum(1 for offset in offsets if offset))
        return offsets

    async def close(
        self, key: str, terminal: ev.Event, writer: str = "", since: str = ""
    ) -> tuple[str, bool]:
        args = [terminal.SerializeToString(), self._ttl_ms(), writer, key, _padded(since)]
        keys = self._keys(validate_key(key))
        with _reachable():
            reply = [_s(x) for x in await self._close(keys=keys, args=args)]
        if reply[0] == "missing":
            raise NotFound(f"no stream buffer {key}")
        if reply[0] == "replaced":
            raise written_elsewhere(key, since)
        return reply[1], reply[0] == "ok"

    async def delete(self, key: str, terminal: ev.Event, requester: str = "") -> bool:
        keys = self._keys(validate_key(key))
        args = [requester, terminal.SerializeToString(), DRAIN_MS, key]
        with _reachable():
            return bool(await self._delete(keys=keys, args=args))

    async def renew(self, keys: Sequence[str]) -> int:
        for key in keys:
            validate_key(key)
        if not keys:
            return 0
        args: list[Any] = [self.prefix, self._lease_ms(), self._open_ttl_ms(), *keys]
        with _reachable():
            return int(await self._renew(keys=[self._leases], args=args))

    async def info(self, key: str) -> StreamInfo:
        meta_key, stream_key, _ = self._keys(validate_key(key))
        with _reachable():
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.hgetall(meta_key)
                pipe.xlen(stream_key)
                pipe.xrevrange(stream_key, count=1)
                meta, length, last = await pipe.execute()
        if not meta or meta.get(b"deleted") == b"1":
            return StreamInfo(key=key)
        return StreamInfo(
            key=key,
            exists=True,
            closed=_s(meta.get(b"closed", b"0")) == "1",
            last_offset=_s(last[0][0]) if last else "",
            owner=_s(meta.get(b"owner", b"")),
            metadata=json.loads(meta.get(b"metadata", b"{}")),
            length=int(length),
        )

    async def _cursor(self, key: str, after: str, terminal_only: bool = False) -> Cursor | None:
        check_offset(after)
        meta_key, stream_key, _ = self._keys(key)
        with _reachable():
            closed, close_offset, gen, deleted, begin = await self.client.hmget(
                meta_key, ["closed", "close_offset", "gen", "deleted", "begin"]
            )
        if closed is None or deleted == b"1":
            raise NotFound(f"no stream buffer {key}")
        if after and begin and (0, 0) < _id_tuple(after) < _id_tuple(_s(begin)):  # (0: from the start)
            # An earlier buffer's offset (the next turn replaced the one the reader followed): its
            # events are not this buffer's continuation. (Should Redis's clock step back between a
            # create and its first append, the buffer's own offsets would be refused too: its readers
            # end `interrupted` on a resume, and the stored reply is unharmed.)
            raise replaced(key, after)
        if _s(closed) == "1" and after and _id_tuple(after) >= _id_tuple(_s(close_offset)):
            return None
        return _RedisCursor(self.client, self._live, stream_key, after, meta_key, gen)

    async def open_buffers(self) -> int:
        with _reachable():
            return int(await self.client.zcard(self._leases))

    def stats(self) -> BackendStats:
        """Subscribers and batch sizes of this process; buffers live in Redis and are not counted here."""
        return BackendStats(subscribers=self._subscribers, max_batch_held=self._max_batch)
