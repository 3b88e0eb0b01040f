"""Chat entries: POST /api/chat (SSE) and GET /api/ws (WebSocket) both call OrchestratorService.ExecuteChat;
POST /api/sessions/{id}/cancel. (The agent routes are in agents.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson
from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sse_starlette.sse import EventSourceResponse

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.deps import authenticate, clients_dep, current_user, settings
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.errors import READ, SSE, WRITE, responses
from agentmesh.gateway.openapi import obj, ok
from agentmesh.gateway.params import ID_PATTERN, MESSAGE_PATTERN, NO_NUL, SessionId
from agentmesh.gateway.sse import drain_options, follow, sse_message, subscribe
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import (
    FailedPrecondition,
    Internal,
    InvalidArgument,
    MeshError,
    from_event,
    from_rpc_error,
    rpc,
)
from agentmesh.libs.ids import MAX_ID, session_key
from agentmesh.libs.streams import Follow
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

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


async def _begin(c: Clients, mesh: MeshSettings, call: grpc.aio.UnaryStreamCall) -> _Turn:
    """The turn's `start`, read from its buffer: ExecuteChat says as soon as session:<id> exists (while
    the turn is being stored), the subscription opens from the buffer's beginning then, so `start` and
    the run's first events come straight from the stream service. A buffer that ends before its
    `start` may have been given up for another session (the agent changed while the turn began): the
    call says that one next, and it is read instead. A turn that does not begin (its refusal, the
    buffer's first event, or the call's error) raises: an HTTP error, not a broken stream."""
    turn = _Turn(call, idle_ms=int(mesh.turn_timeout_s * 1000))
    try:
        session_id = await turn.created
        while True:
            turn.key = session_key(session_id)
            turn.subscription = subscribe(c, turn.key, "", turn.idle_ms)
            first = await turn.first_event()
            if first.HasField("start"):
                turn.start = first
                return turn
            given_up = bool(first.offset) and first.error.code == ev.ERROR_CODE_CANCELLED  # (a move's mark)
            moved = await turn.moved_to() if given_up else None
            if moved is None:
                raise (
                    from_event(first.error) if first.HasField("error") else Internal("the turn did not start")
                )
            turn.subscription.cancel()
            session_id = moved
    except BaseException:
        turn.close()
        raise


class _Turn:
    """A turn ExecuteChat started (events_from_stream), read from its buffer `key`. The call stays open
    while the turn runs, read by `watcher`: `created` is its first answer (the session whose buffer
    exists), `moved` a second one (the session the turn runs in instead), `outcome` an end the buffer
    could not store, or the call's failure (the orchestrator went away)."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, idle_ms: int) -> None:
        loop = asyncio.get_running_loop()
        self.call, self.idle_ms = call, idle_ms
        self.key = ""
        self.start: ev.Event | None = None
        self.subscription: Follow | None = None
        self.created: asyncio.Future[str] = loop.create_future()
        self.moved: asyncio.Future[str] = loop.create_future()
        self.outcome: asyncio.Future[ev.Event] = loop.create_future()
        self.watcher = asyncio.create_task(self._watch(), name="watch:turn")

    async def _watch(self) -> None:
        try:
            async for response in self.call:
                if response.session_id and not self.created.done():
                    self.created.set_result(response.session_id)
                elif response.session_id and not self.moved.done():
                    self.moved.set_result(response.session_id)
                for event in response.events:
                    if not events.is_terminal(event) or event.offset:
                        continue
                    if not self.created.done():
                        self.created.set_exception(from_event(event.error))
                    elif not self.outcome.done():
                        self.outcome.set_result(event)
            if not self.created.done():
                self.created.set_exception(Internal("the turn ended before it started"))
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            if not self.created.done():
                self.created.set_exception(err)
            elif exc.code() != grpc.StatusCode.CANCELLED and not self.outcome.done():
                self.outcome.set_result(events.error(err))

    async def first_event(self) -> ev.Event:
        """The buffer's first event, or the turn's end as the call reports it when that comes first."""
        assert self.subscription is not None
        first = asyncio.ensure_future(anext(self.subscription))
        try:
            await asyncio.wait({first, self.outcome}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not first.done():
                first.cancel()
        if not first.done() or first.cancelled():
            return self.outcome.result()
        try:
            return first.result()
        except StopAsyncIteration:
            return events.error(Internal("the turn's buffer ended before it started"))

    async def moved_to(self) -> str | None:
        """After a buffer that ended before its `start`: the session the turn moved to, or None once
        the call has ended without saying one (the turn did not begin: the buffer's end says why)."""
        either: set[asyncio.Future[Any]] = {self.moved, self.watcher}
        await asyncio.wait(either, timeout=END_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
        return self.moved.result() if self.moved.done() else None

    def close(self) -> None:
        """Stops reading (a client that left): the turn itself goes on."""
        if self.subscription is not None:
            self.subscription.cancel()
        self.call.cancel()
        self.watcher.cancel()


async def _turn_events(c: Clients, turn: _Turn, drain: Drain) -> AsyncIterator[ev.Event]:
    """The events of a turn `_begin` started: its `start`, then session:<id> from the stream service,
    one hop from the runtime that writes it (the path a resume takes). When the orchestrator goes away,
    or reports an end the buffer could not store, that ends the reading."""
    assert turn.start is not None
    try:
        yield turn.start
        follow_turn = follow(
            c, turn.key, turn.start.offset, turn.idle_ms, drain, turn.outcome, turn.subscription
        )
        async for event in follow_turn:
            if events.is_terminal(event) and event.offset:
                # The buffer ended (a cancel, the turn's own end): the stream ends once the turn
                # is over too, so the reply it settled is stored when the client reads it.
                await asyncio.wait({turn.watcher}, timeout=END_WAIT_S)
            yield event
    finally:
        turn.close()


@router.post("/api/chat", response_class=EventSourceResponse, responses={200: SSE, **responses(*WRITE, 409)})
async def chat(
    body: ChatRequest, request: Request, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> EventSourceResponse:
    mesh = settings(request)
    turn = await _begin(c, mesh, _execute(c, body))
    drain: Drain = request.app.state.drain

    async def stream() -> AsyncIterator[dict[str, str]]:
        async for event in _turn_events(c, turn, drain):
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
        try:
            turn = await _begin(c, socket.app.state.settings, _execute(c, body))
        except MeshError as err:
            await send(_ws_error(err))
            return
        async for event in _turn_events(c, turn, drain):
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
