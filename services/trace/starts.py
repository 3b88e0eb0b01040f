"""A turn's `start`, appended to its buffer by the trace service as soon as BeginTurn has stored the
turn's messages (BeginTurnRequest.start_key): the buffer gets it one hop sooner than from the caller
after the answer, and a run waiting for it (RunAgentRequest.await_start) goes on sooner."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import from_rpc_error
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.stream.v1 import stream_service_pb2_grpc

log = logging.getLogger(__name__)

# Refusals that store nothing: the caller appends the start itself (and meets the same refusal, if it
# lasts, on its own path). A buffer not there yet (its CreateStream still under way) is the usual one.
REFUSED = frozenset(
    {
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class TurnStarts:
    """Appends turns' `start` events to the stream service, as the calling user."""

    def __init__(
        self, stream: Callable[[], stream_service_pb2_grpc.StreamServiceStub], timeout_s: float
    ) -> None:
        self.stream = stream  # (the channel opens on first use)
        self.timeout_s = timeout_s

    async def append(
        self, key: str, start: ev.TurnStart, within_s: float | None = None
    ) -> tuple[str, ev.StreamError | None]:
        """(`start`'s offset, None) once appended; ("", None) when the buffer refused it (nothing
        stored); ("", the error) when the append failed and may have been stored all the same (a
        deadline, a lost connection): then the turn cannot go on. `within_s`: what is left of the
        caller's deadline (the append ends before it)."""
        timeout = self.timeout_s if within_s is None else max(0.05, min(self.timeout_s, 0.9 * within_s))
        request = ss.AppendEventsRequest(key=key, events=[ev.Event(start=start)])
        try:
            resp = await self.stream().AppendEvents(request, timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in REFUSED:
                log.debug("the buffer refused a turn's start: %s", exc.details(), extra={"key": key})
                return "", None
            log.warning("could not append a turn's start: %s", exc.details(), extra={"key": key})
            return "", from_rpc_error(exc).to_event()
        return resp.offsets[0], None
