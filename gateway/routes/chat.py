"""Chat entries: POST /api/chat (SSE) and GET /api/ws (WebSocket) both call OrchestratorService.ExecuteChat;
POST /api/sessions/{id}/cancel. (The agent routes are in agents.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import orjson
from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from gateway.deps import authenticate, clients_dep, current_user, settings
from gateway.drain import Drain
from gateway.errors import READ, SSE, WRITE, responses
from gateway.openapi import obj, ok
from gateway.params import ID_PATTERN, MESSAGE_PATTERN, NO_NUL, SessionId
from gateway.sse import drain_options, follow, sse_message, subscribe
from libs import events
from libs.clients import Clients
from libs.config import MeshSettings
from libs.errors import FailedPrecondition, Internal, InvalidArgument, MeshError, from_rpc_error, rpc
from libs.ids import MAX_ID, session_key

router = APIRouter()
END_WAIT_S = 10.0  # the longest a live turn's terminal event waits for the turn to be over
log = logging.getLogger(__name__)


class ChatRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    agent: str = Field(min_length=1, max_length=200, pattern=NO_NUL, examples=["general"])
    message: str = Field(
        min_length=1,
        max_length=100_000,
        json_schema_extra={"pattern": MESSAGE_PATTERN},  # checked below, with a clearer message
        examples=["hello"],
    )
    session_id: str | None = Field(default=None, alias="sessionId", pattern=ID_PATTERN, max_length=MAX_ID)

    @field_validator("message")
    @classmethod
    def not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("message must not be empty")
        if "\x00" in value:
            raise ValueError("message must not contain U+0000")
        return value


def _execute(c: Clients, body: ChatRequest) -> grpc.aio.UnaryStreamCall:
    request = orc.ExecuteChatRequest(
        agent=body.agent, message=body.message, session_id=body.session_id or "", events_from_stream=True
    )
    return c.orchestrator.ExecuteChat(request)


async def _first(c: Clients, mesh: MeshSettings, call: grpc.aio.UnaryStreamCall) -> _Begun:
    """The first response, so that an early failure becomes an HTTP error, not a broken stream; and
    the subscription to the turn's buffer after its `start`, started at once (the run's first events
    may follow `start` closely: they are on their way while the response begins)."""
    response = await rpc(call.read())
    if response is grpc.aio.EOF:
        raise Internal("the turn ended before it started")
    begun = _Begun(response, idle_ms=int(mesh.turn_timeout_s * 1000))
    for event in response.events:
        if events.kind(event) == "start" and event.offset:
            begun.start, begun.key = event, session_key(event.start.session_id)
            begun.subscription = subscribe(c, begun.key, event.offset, begun.idle_ms)
    return begun


@dataclass
class _Begun:
    """The first response of ExecuteChat, its `start`, and the subscription after it (to `key`, with
    the idle timeout `idle_ms`, as `follow` goes on)."""

    response: orc.ExecuteChatResponse
    idle_ms: int
    start: ev.Event | None = None
    key: str = ""
    subscription: grpc.aio.UnaryStreamCall | None = None

    def cancel(self) -> None:
        if self.subscription is not None:
            self.subscription.cancel()


async def _turn_events(
    c: Clients, call: grpc.aio.UnaryStreamCall, first: _Begun, drain: Drain
) -> AsyncIterator[ev.Event]:
    """The events of a turn ExecuteChat started (events_from_stream): `start`, its first response,
    then session:<id> read from the stream service, one hop from the runtime that writes it (the path
    a resume takes). The call stays open while the turn runs: when the orchestrator goes away, or
    reports an end the buffer could not store, that ends the reading."""
    start = first.start
    try:
        for event in first.response.events:
            yield event
            if events.is_terminal(event):
                return
        if start is None:
            yield events.error(Internal("the turn did not start"))
            return
        outcome: asyncio.Future[ev.Event] = asyncio.get_running_loop().create_future()

        async def watch() -> None:
            try:
                async for response in call:
                    for event in response.events:
                        if events.is_terminal(event) and not event.offset and not outcome.done():
                            outcome.set_result(event)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.CANCELLED and not outcome.done():
                    outcome.set_result(events.error(from_rpc_error(exc)))

        watcher = asyncio.create_task(watch(), name=f"watch:{start.start.session_id}")
        try:
            turn = follow(c, first.key, start.offset, first.idle_ms, drain, outcome, first.subscription)
            async for event in turn:
                if events.is_terminal(event) and event.offset:
                    # The buffer ended (a cancel, the turn's own end): the stream ends once the turn
                    # is over too, so the reply it settled is stored when the client reads it.
                    await asyncio.wait({watcher}, timeout=END_WAIT_S)
                yield event
        finally:
            watcher.cancel()
    finally:
        first.cancel()  # the subscription, when it was never read (once read, a no-op)
        call.cancel()  # a client that left stops reading; the turn itself goes on


@router.post("/api/chat", response_class=EventSourceResponse, responses={200: SSE, **responses(*WRITE, 409)})
async def chat(
    body: ChatRequest, request: Request, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> EventSourceResponse:
    call = _execute(c, body)
    mesh = settings(request)
    try:
        first = await _first(c, mesh, call)
    except BaseException:
        call.cancel()
        raise
    drain: Drain = request.app.state.drain

    async def stream() -> AsyncIterator[dict[str, str]]:
        async for event in _turn_events(c, call, first, drain):
            yield sse_message(event)

    return EventSourceResponse(stream(), ping=mesh.stream.heartbeat_s, **drain_options(mesh))


@router.post(
    "/api/sessions/{session_id}/cancel",
    responses={**ok(obj(cancelled={"type": "boolean"})), **responses(*READ)},
)
async def cancel(
    session_id: SessionId, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> dict[str, bool]:
    resp = await rpc(c.orchestrator.CancelChat(orc.CancelChatRequest(session_id=session_id)))
    return {"cancelled": resp.cancelled}


def _ws_error(err: MeshError) -> dict[str, Any]:
    return {"type": "error", "code": err.code_name, "message": err.message, "status": err.http_status}


@router.websocket("/api/ws")
async def ws(socket: WebSocket) -> None:
    """Messages in: {"type": "chat", agent, message, sessionId?} and {"type": "cancel", sessionId}.
    Messages out: the same event objects as the SSE `data:` lines, plus `offset`. Leaving the socket
    stops reading, never the turn (resume it with GET /api/sessions/{id}/stream)."""
    header = socket.headers.get("authorization")
    token = socket.query_params.get("apiKey") or socket.query_params.get("token")
    try:
        # The acting user of everything this socket does from here on.
        await authenticate(socket.app.state, header or (f"Bearer {token}" if token else None))
    except MeshError as err:
        await socket.accept()  # then close with a reason the client can read (a refused handshake has none)
        await socket.close(code=4401, reason=err.message)
        return
    await socket.accept()
    c: Clients = socket.app.state.clients
    drain: Drain = socket.app.state.drain
    turn: asyncio.Task[None] | None = None
    send_lock = asyncio.Lock()

    async def send(data: dict[str, Any]) -> None:
        async with send_lock:
            await socket.send_text(orjson.dumps(data).decode())

    async def farewell() -> None:
        """The gateway shuts down: a last `error` (code shutdown) that says how to resume, then 1012."""
        await drain.event.wait()
        if turn is not None and not turn.done():
            turn.cancel()  # stops reading; the turn goes on in the orchestrator
        with contextlib.suppress(Exception):
            await send(_ws_error(drain.farewell()))
            await socket.close(code=1012, reason="the gateway is shutting down")

    leaving = asyncio.create_task(farewell())

    async def run_turn(body: ChatRequest) -> None:
        call = _execute(c, body)
        try:
            first = await _first(c, socket.app.state.settings, call)
        except MeshError as err:
            call.cancel()
            await send(_ws_error(err))
            return
        async for event in _turn_events(c, call, first, drain):
            await send(events.to_dict(event, with_offset=True))

    async def handle(data: Any) -> None:
        nonlocal turn
        kind = data.get("type") if isinstance(data, dict) else None
        if kind == "chat":
            if turn is not None and not turn.done():
                raise FailedPrecondition("a turn is already streaming on this socket")
            try:
                body = ChatRequest.model_validate({k: v for k, v in data.items() if k != "type"})
            except ValidationError as exc:
                raise InvalidArgument(str(exc.errors()[0]["msg"])) from exc
            turn = asyncio.create_task(run_turn(body))
        elif kind == "cancel":
            request = orc.CancelChatRequest(session_id=str(data.get("sessionId", "")))
            resp = await rpc(c.orchestrator.CancelChat(request))
            await send({"type": "cancel-result", "cancelled": resp.cancelled})
        else:
            raise InvalidArgument("type must be chat or cancel")

    try:
        while True:
            try:
                data = await socket.receive_json()
                await handle(data)
            except (json.JSONDecodeError, KeyError, ValueError):
                await send(_ws_error(InvalidArgument("messages must be JSON objects")))
            except MeshError as err:
                await send(_ws_error(err))
    except (WebSocketDisconnect, RuntimeError):  # RuntimeError: receive after the farewell closed it
        pass
    finally:
        leaving.cancel()
        if turn is not None and not turn.done():
            turn.cancel()
            with contextlib.suppress(BaseException):
                await turn
