"""Retry with backoff: the one loop behind every bounded retry of an outgoing call (a peer's idempotent
read in libs/peer_http.py, an A2A push notification in gateway/a2a/push.py)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
E = TypeVar("E", bound=BaseException)


async def with_backoff(
    call: Callable[[], Awaitable[T]],
    *,
    retry_on: type[E] | tuple[type[E], ...],
    retries: int,
    delay_s: float,
    max_delay_s: float = math.inf,
    on_retry: Callable[[E, float], None] | None = None,
) -> T:
    """`call()`'s result. While it raises one of `retry_on`, it is called again, at most `retries` more
    times, after a pause of `delay_s` that doubles each time up to `max_delay_s`; `on_retry(error,
    pause)` is told before each pause. The last attempt's error is raised; any other at once."""
    delay = delay_s
    for _ in range(max(0, retries)):
        try:
            return await call()
        except retry_on as err:
            if on_retry is not None:
                on_retry(err, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, max_delay_s)
    return await call()
