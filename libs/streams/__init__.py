"""Many buffers on one call: follows (follower.py) and writes (writer.py); docs/design/streams.md."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Sequence
from typing import Any, Protocol


class _Call(Protocol):
    @property
    def reader(self) -> Awaitable[Any]: ...

    def cancel(self) -> None: ...


async def end_calls(calls: Sequence[_Call]) -> None:
    """Cancels every call, then waits until each one's reader task is over (its failure swallowed: the
    process is closing its clients)."""
    for call in calls:
        call.cancel()
    for call in calls:
        with contextlib.suppress(BaseException):
            await call.reader
