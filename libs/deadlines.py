"""The deadline of the call being served, for the calls it makes in turn (docs/federation.md#budgets).

Every servicer method (libs.errors.grpc_errors) records when its caller stops waiting; work that calls
out of the mesh (a peer's HTTP) takes what is left minus a margin, so that the service still has time
to answer otherwise (a read from the cached copy, a clear error) before its caller gives up. The value
lives in a context variable: each call's task has its own, and the tasks it starts inherit it.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

_ends: contextvars.ContextVar[float | None] = contextvars.ContextVar("agentmesh_call_deadline", default=None)


def serve(context: Any) -> None:
    """Records the deadline of the call `context` serves (a grpc.aio.ServicerContext; none: unbounded)."""
    try:
        remaining = context.time_remaining()
    except (AttributeError, NotImplementedError):
        remaining = None
    _ends.set(None if remaining is None else time.monotonic() + float(remaining))


def left() -> float | None:
    """Seconds until the call being served ends (None: no deadline, or outside any call)."""
    ends = _ends.get()
    return None if ends is None else ends - time.monotonic()


def budget(margin_s: float, cap_s: float | None = None) -> float | None:
    """What work started now may take: what is left of the call minus `margin_s` (never below 0), at
    most `cap_s`; None when neither bounds it."""
    remaining = left()
    if remaining is None:
        return cap_s
    mine = max(0.0, remaining - margin_s)
    return mine if cap_s is None else min(mine, cap_s)
