"""Waiting for the stream service to answer again after a call to it failed (it restarted, a replica
went away): the writers and followers of a process go on from where they were once it does, for at most
`stream.reconnect_s` since it last answered (docs/design/streams.md#reconnects)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import grpc

from agentmesh.libs.errors import MeshError

FIRST_PAUSE_S = 0.05  # between two calls that failed at once: doubles, up to MAX_PAUSE_S
MAX_PAUSE_S = 1.0


def went_away(err: BaseException | None) -> bool:
    """A failure of a call to the stream service that another call may not meet: the service (or the
    connection to it) went away, or it is stopping (SHUTDOWN). Another reason is the answer itself."""
    return isinstance(err, MeshError) and err.grpc_code == grpc.StatusCode.UNAVAILABLE


class Reconnect:
    """How long the stream service has been gone, and the wait before the next call to it. The
    connection itself is gRPC's to restore (the channel's reconnect backoff, libs/rpc.py); between two
    calls that failed at once there is a pause as well, growing, so that a service that takes
    connections but no calls (a stopping one) is not called in a loop."""

    def __init__(self, ready: Callable[[], Awaitable[None]], budget_s: float) -> None:
        self._ready = ready  # returns once the channel to the stream service is connected
        self.budget_s = budget_s
        self._down_since: float | None = None
        self._pauses = 0

    def reset(self) -> None:
        """The service answered (or the wait gave up): the next failure starts a new budget."""
        self._down_since = None
        self._pauses = 0

    async def wait(self) -> bool:
        """After a failed call: returns True once another call may go, False when the service was gone
        for the whole budget (counted from the first failure since it last answered; then the next
        failure starts a new one)."""
        loop = asyncio.get_running_loop()
        if self._down_since is None:
            self._down_since = loop.time()
        remaining = self._down_since + self.budget_s - loop.time()
        pause = min(MAX_PAUSE_S, FIRST_PAUSE_S * 2**self._pauses)
        self._pauses += 1
        try:
            if remaining <= 0:
                raise TimeoutError
            async with asyncio.timeout(remaining):
                await asyncio.sleep(pause)
                await self._ready()
        except TimeoutError:
            self.reset()
            return False
        return True
