"""Retry with backoff: the one policy behind every bounded retry of an outgoing call (a peer's
idempotent read in libs/peer_http.py, an A2A push notification in gateway/a2a/push.py), on tenacity."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
)

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

    def before_sleep(state: RetryCallState) -> None:
        if on_retry is not None and state.outcome is not None and state.next_action is not None:
            on_retry(state.outcome.exception(), state.next_action.sleep)  # type: ignore[arg-type]

    retrying = AsyncRetrying(
        retry=retry_if_exception_type(retry_on),
        stop=stop_after_attempt(max(0, retries) + 1),
        wait=wait_exponential(multiplier=delay_s, exp_base=2, max=max_delay_s),
        before_sleep=before_sleep,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await call()
    raise AssertionError("unreachable: tenacity raises or returns")  # pragma: no cover
