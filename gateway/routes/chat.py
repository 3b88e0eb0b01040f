"""Chat entries: POST /api/chat (SSE) and GET /api/ws (WebSocket) both ask OrchestratorService.RunTurn
for a chat turn (gateway/turns.py); POST /api/sessions/{id}/cancel. (The agent routes are in
agents.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, WebSocket, WebSocketDisconnect
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from sse_starlette.sse import EventSourceResponse

from agentmesh.gateway.deps import authenticate, clients_dep, current_user, settings
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.errors import READ, SSE, WRITE, responses
from agentmesh.gateway.openapi import obj, ok
from agentmesh.gateway.params import ID_PATTERN, MESSAGE_PATTERN, NO_NUL, SessionId, SubagentId
from agentmesh.gateway.sse import drain_options, sse_message
from agentmesh.gateway.turns import start_turn, turn_events
from agentmesh.libs import events, jsonbound
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import (
    FailedPrecondition,
    InvalidArgument,
    MeshError,
    rpc,
)
from agentmesh.libs.ids import MAX_ID
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

router = APIRouter()
log = logging.getLogger(__name__)


class ChatRequest(BaseModel):
    model_config = ConfigDict(
        populate_by_name=True,
        extra="forbid",
        json_schema_extra={"dependentRequired": {"parentSequence": ["traceId"]}},
    )

    agent: str = Field(min_length=1, max_length=200, pattern=NO_NUL, examples=["general"])
    message: str = Field(
        min_length=1,
        max_length=100_000,
        json_schema_extra={"pattern": MESSAGE_PATTERN},  # checked below, with a clearer message
        examples=["hello"],
    )
    session_id: str = Field(
        default="",
        validation_alias=AliasChoices("traceId", "sessionId"),
        serialization_alias="traceId",
        pattern=ID_PATTERN,
        max_length=MAX_ID,
        description="The trace to continue (a chat's id; `sessionId` is accepted too); none: a new chat.",
    )
    parent_sequence: int | None = Field(
        default=None,
        alias="parentSequence",
        ge=0,
        le=2**53 - 1,
        description="Branch off this message of the trace (retry, regenerate, edit; 0: a new first "
        "message): the turn follows it instead of the head, and the trace's main path follows the new "
        "branch.",
    )

    @model_validator(mode="after")
    def branches_of_a_trace(self) -> ChatRequest:
        if self.parent_sequence is not None and not self.session_id:
            raise ValueError("parentSequence names a message of the trace given as traceId")
        return self

    @field_validator("message")
    @classmethod
    def not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("message must not be empty")
        if "\x00" in value:
            raise ValueError("message must not contain U+0000")
        return value


def _request(body: ChatRequest) -> orc.RunTurnRequest:
    return orc.RunTurnRequest(
        trace_id=body.session_id,
        agent=body.agent,
        input=body.message,
        parent_sequence=body.parent_sequence,
        chat=orc.ChatCaller(),
    )


@router.post(
    "/api/chat", response_class=EventSourceResponse, responses={200: SSE, **responses(*WRITE, 409, 429)}
)
async def chat(
    body: ChatRequest, request: Request, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> EventSourceResponse:
    mesh = settings(request)
    turn = await start_turn(c, _request(body))
    drain: Drain = request.app.state.drain

    async def stream() -> AsyncIterator[bytes]:
        async for event in turn_events(c, turn, drain):
            yield sse_message(event)

    return EventSourceResponse(stream(), ping=mesh.stream.heartbeat_s, **drain_options(mesh))


@router.post(
    "/api/sessions/{session_id}/cancel",
    responses={**ok(obj(cancelled={"type": "boolean"})), **responses(*READ)},
)
async def cancel(
    session_id: SessionId, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> dict[str, bool]:
    resp = await rpc(c.orchestrator.CancelTurn(orc.CancelTurnRequest(trace_id=session_id)))
    return {"cancelled": resp.cancelled}


@router.post(
    "/api/subagents/{subagent_id}/cancel",
    responses={**ok(obj(cancelled={"type": "boolean"})), **responses(*READ)},
)
async def cancel_subagent(
    subagent_id: SubagentId, user: str = Depends(current_user), c: Clients = Depends(clients_dep)
) -> dict[str, bool]:
    """Stops one subagent (a background one's stop): it ends `cancelled`, the rest of its batch and
    the turn that started it go on."""
    resp = await rpc(c.orchestrator.CancelTurn(orc.CancelTurnRequest(subagent_id=subagent_id)))
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
            turn = await start_turn(c, _request(body))
        except MeshError as err:
            await send(_ws_error(err))
            return
        async for event in turn_events(c, turn, drain):
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
            request = orc.CancelTurnRequest(trace_id=str(data.get("traceId") or data.get("sessionId") or ""))
            resp = await rpc(c.orchestrator.CancelTurn(request))
            await send({"type": "cancel-result", "cancelled": resp.cancelled})
        else:
            raise InvalidArgument("type must be chat or cancel")

    try:
        while True:
            try:
                # the JSON bound of every entry (libs/jsonbound.py): a breach is an error message, not a
                # closed socket
                await handle(jsonbound.loads(await socket.receive_text()))
            except (KeyError, ValueError):  # a binary message, or text that is not JSON
                await send(_ws_error(InvalidArgument("messages must be JSON objects")))
            except jsonbound.BoundError as err:
                log.warning("websocket message refused: %s", err.message)
                await send(_ws_error(err))
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
