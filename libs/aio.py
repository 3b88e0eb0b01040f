"""asyncio helpers every process uses."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def to_the_end(aw: Awaitable[T]) -> T:
    """Awaits `aw` to its end even when the waiting task is cancelled meanwhile (then re-raises the
    cancellation once `aw` is done). For the settling of failed work: unlike a bare `asyncio.shield`,
    nobody learns that the work ended before its rows are settled."""
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait({task})
        raise
