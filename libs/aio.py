"""asyncio helpers every process uses."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

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


# Allocations of container objects between two young collections (CPython's default: 700). Most of
# what a turn allocates is freed by reference counting before 10,000 more come: the collector runs
# about a fifth as often and for a quarter of the time (docs/operations.md, "Garbage collection").
YOUNG_COLLECTION_EVERY = 10_000

_frozen_objects = 0


def settle_heap() -> None:
    """For a process that now serves: what it imported and built lives as long as it does, so the
    garbage collector stops walking it (`gc.freeze`). A full collection under load then walks only
    what the load made, instead of stalling every stream of the process while it walks the modules
    too. Young collections come less often (YOUNG_COLLECTION_EVERY)."""
    global _frozen_objects
    gc.freeze()
    gc.set_threshold(YOUNG_COLLECTION_EVERY, *gc.get_threshold()[1:])
    # Counted once here: gc.get_freeze_count() walks every frozen object (about 15 ms for 200,000), a
    # stall of the event loop on each /metrics scrape if asked there.
    _frozen_objects = gc.get_freeze_count()


def frozen_objects() -> int:
    """How many objects settle_heap froze (0 before it ran)."""
    return _frozen_objects


def run(main: Coroutine[Any, Any, T]) -> T:
    """Runs `main` to its end on a new event loop: uvloop's (libuv: a cheaper loop iteration, socket
    and timer handling than asyncio's selector loop), the loop every process of the mesh runs on;
    AGENTMESH_EVENT_LOOP=asyncio keeps asyncio's own."""
    if os.environ.get("AGENTMESH_EVENT_LOOP", "uvloop") == "asyncio":
        return asyncio.run(main)
    import uvloop

    return uvloop.run(main)
