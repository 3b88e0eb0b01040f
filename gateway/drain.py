"""The gateway's shutdown, as its clients see it. When the process is told to stop, every live SSE
response and WebSocket ends with a last `error` event (code `shutdown`) that says how to resume, before
the connection closes; the turns themselves go on in the orchestrator."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc

from agentmesh.libs.errors import Shutdown
from agentmesh.libs.streams.follower import Follow

RESUME_HINT = "resume with the last event id (GET /api/sessions/{id}/stream) once the gateway is back"


class Drain:
    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    @property
    def event(self) -> asyncio.Event:
        if self._event is None:  # made in the serving loop, at first use
            self._event = asyncio.Event()
        return self._event

    @property
    def draining(self) -> bool:
        return self._event is not None and self._event.is_set()

    def begin(self) -> None:
        """Shutdown starts (called in the serving loop)."""
        self.event.set()

    def farewell(self) -> Shutdown:
        return Shutdown(f"the gateway is shutting down; {RESUME_HINT}")

    @contextlib.contextmanager
    def cancels(self, call: grpc.aio.Call | Follow) -> Iterator[None]:
        """While the block runs, shutdown cancels `call` (one watcher per connection, not per event)."""
        watcher = asyncio.ensure_future(self.event.wait())
        watcher.add_done_callback(lambda w: None if w.cancelled() else call.cancel())
        try:
            yield
        finally:
            watcher.cancel()

    def ended_it(self) -> bool:
        """True inside `except asyncio.CancelledError` when the drain cancelled the call, not the task."""
        task = asyncio.current_task()
        return self.draining and task is not None and task.cancelling() == 0
