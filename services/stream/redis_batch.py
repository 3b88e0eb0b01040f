"""Calls of one Lua script made in the same pass of the event loop, sent to Redis as one pipeline.

The batches of a WriteStreams request (one for each run of an agent runtime that streamed since its
last request) are appended by one task per writer, all started in one pass of the loop. Each append
sent on its own is a round trip of its own: a socket write, a wake-up for the reply, a connection of
the pool. Gathered, they are one pipeline, not a transaction: one write of every call and one read of
their replies, in call order, each caller still getting its own reply or its own error.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis import asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

_Call = tuple[list[Any], list[Any], "asyncio.Future[Any]"]


class ScriptBatch:
    """`await batch(keys=..., args=...)` as `await script(keys=..., args=...)` would, batched."""

    def __init__(self, client: aioredis.Redis, script: AsyncScript) -> None:
        self._client = client
        self._script = script
        self._pending: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    def __call__(self, keys: list[Any], args: list[Any]) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((keys, args, future))
        if len(self._pending) == 1:  # the first of this pass: the others are made before it goes
            loop.call_soon(self._send)
        return future

    def _send(self) -> None:
        calls, self._pending = self._pending, []
        task = asyncio.ensure_future(self._run(calls))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _run(self, calls: list[_Call]) -> None:
        try:
            replies = await self._replies(calls)
        except BaseException as exc:  # the connection (or this task) failed: every caller learns it
            for _, _, future in calls:
                if future.done():
                    continue
                if isinstance(exc, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
            return
        for (_, _, future), reply in zip(calls, replies, strict=True):
            if future.done():  # its caller gave up: the append was sent all the same
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _replies(self, calls: list[_Call]) -> list[Any]:
        if len(calls) == 1:
            keys, args, _ = calls[0]
            return [await self._script(keys=keys, args=args)]
        pipe = self._client.pipeline(transaction=False)
        for keys, args, _ in calls:
            pipe.evalsha(self._script.sha, len(keys), *keys, *args)
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for i, reply in enumerate(replies):
            if isinstance(reply, NoScriptError):  # Redis restarted or flushed its scripts: load, send again
                keys, args, _ = calls[i]
                try:
                    replies[i] = await self._script(keys=keys, args=args)
                except Exception as exc:
                    replies[i] = exc
        return replies

    async def aclose(self) -> None:
        """Waits for the pipelines under way (their callers get their replies)."""
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
