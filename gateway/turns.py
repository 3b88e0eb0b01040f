"""A turn the gateway asks the orchestrator for (OrchestratorService.RunTurn), read from its buffer:
the one way POST /api/chat, the WebSocket and POST /api/traces/{id}/run run a turn
(docs/design/turns.md, "Chat").

The call's first answer says the turn began (its trace, its buffer and `start`); a turn that does not
begin answers an error instead, which becomes an HTTP error, not a broken stream. The events then
come from the buffer, one hop from the runtime that writes them, followed from that answer on (while
the response is set up); the call stays open until the turn ends, so the reader learns when the
orchestrator goes away or ends the turn where the buffer could not say so.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.sse import follow, subscribe
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Internal, from_event, from_rpc_error, rpc
from agentmesh.libs.streams.follower import Follow
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

END_WAIT_S = 10.0  # the longest the end of a live turn's buffer waits for the turn to be over


@dataclass
class Started:
    """A turn that began: its first answer, the follow of its buffer, and the call that reports its end."""

    call: grpc.aio.UnaryStreamCall
    begun: orc.TurnBegun
    follow: Follow
    ended: asyncio.Task[orc.TurnEnded | None]

    def close(self) -> None:
        """Stops reading (a client that left): a chat turn itself goes on."""
        self.call.cancel()
        self.follow.cancel()
        self.ended.cancel()


async def start_turn(clients: Clients, request: orc.RunTurnRequest) -> Started:
    """Asks for the turn; returns once it began (raises why it did not)."""
    call = clients.orchestrator.RunTurn(request, timeout=clients.settings.turn_timeout_s + END_WAIT_S)
    try:
        first = await rpc(call.read())
        if first is grpc.aio.EOF or not first.HasField("begun"):
            raise Internal("the turn ended before it began")
    except BaseException:
        call.cancel()
        raise
    begun = first.begun
    idle_ms = int(clients.settings.turn_timeout_s * 1000)
    handle = subscribe(clients, begun.stream_key, begun.start.offset, idle_ms)
    return Started(call, begun, handle, asyncio.create_task(_ended(call), name="turn:ended"))


async def _ended(call: grpc.aio.UnaryStreamCall) -> orc.TurnEnded | None:
    """The turn's end as the orchestrator reports it, or None when the call broke first (read to the
    call's end, which follows at once)."""
    ended = None
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.HasField("ended"):
                ended = response.ended
    except grpc.aio.AioRpcError:
        return None
    return ended


def ended_event(ended: orc.TurnEnded | None, failure: BaseException | None = None) -> ev.Event:
    """The terminal event a reader gets when the buffer cannot say how the turn ended."""
    if ended is not None and ended.HasField("end"):
        return ended.end
    if ended is not None and ended.HasField("error"):
        return events.error(from_event(ended.error))
    if isinstance(failure, grpc.aio.AioRpcError):
        return events.error(from_rpc_error(failure))
    return events.error(Internal("the orchestrator went away before the turn ended"))


async def turn_events(clients: Clients, turn: Started, drain: Drain) -> AsyncIterator[ev.Event]:
    """`start`, then the turn's buffer up to its terminal event. Once the buffer ends, the reading ends
    when the turn is over too, so the answer it settled is stored when the client reads the end. When
    the orchestrator goes away (or reports an end the buffer could not store), that ends the reading."""
    begun = turn.begun
    interrupt: asyncio.Future[ev.Event] = asyncio.get_running_loop().create_future()

    def on_end(done: asyncio.Task[orc.TurnEnded | None]) -> None:
        ended = None if done.cancelled() else done.result()
        if interrupt.done():
            return
        if ended is None or not ended.end.offset:  # the buffer will not say it: the call does
            interrupt.set_result(ended_event(ended))

    turn.ended.add_done_callback(on_end)
    try:
        yield begun.start
        key, offset, handle = begun.stream_key, begun.start.offset, turn.follow
        async for event in follow(clients, key, offset, drain=drain, interrupt=interrupt, started=handle):
            if events.is_terminal(event) and event.offset:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait({turn.ended}, timeout=END_WAIT_S)
            yield event
    finally:
        if not interrupt.done():
            interrupt.cancel()
        turn.close()
