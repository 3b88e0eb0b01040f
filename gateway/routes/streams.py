"""Resumable live streams: a session's running turn, an agent-invoke callee (a2a task), a subagent card."""

from __future__ import annotations

from typing import Any

import grpc
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from agentmesh.gateway import deps
from agentmesh.gateway.errors import READ, SSE, responses
from agentmesh.gateway.params import RESUME_PARAMETERS, SessionId, SubagentId, TaskId
from agentmesh.gateway.sse import stream_response
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.ids import a2a_key, subagent_key, trace_key
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_service_pb2 as ts

router = APIRouter(tags=["streams"])

_NO_BUFFER = {
    "type": "object",
    "properties": {"active": {"const": False}, "reason": {"const": "no-buffer"}},
    "required": ["active", "reason"],
}
# 200: the events (replay, then live), or {"active": false, "reason": "no-buffer"} when the resource is
# the caller's but has no buffer (yet, or any more).
STREAM: dict[int | str, dict[str, Any]] = {
    200: {**SSE, "content": {**SSE["content"], "application/json": {"schema": _NO_BUFFER}}},
    **responses(*READ),
}


@router.get("/api/sessions/{session_id}/stream", responses=STREAM, openapi_extra=RESUME_PARAMETERS)
async def session_stream(
    session_id: SessionId,
    request: Request,
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients_dep),
    settings: MeshSettings = Depends(deps.settings_dep),
) -> Response:
    """Resumes the live turn of a session (SSE, replay then live)."""

    async def owns() -> bool:
        return await _found(clients.trace.GetTrace(ts.GetTraceRequest(trace_id=session_id)))

    return await stream_response(request, clients, settings, trace_key(session_id), owns)


@router.get("/api/agents/a2a/stream", responses=STREAM, openapi_extra=RESUME_PARAMETERS)
async def a2a_stream(
    request: Request,
    task_id: TaskId,
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients_dep),
    settings: MeshSettings = Depends(deps.settings_dep),
) -> Response:
    """The callee's live reply of an agent-invoke call, readable by the caller session's owner."""

    async def owns() -> bool:
        return await _found(clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task_id)))

    return await stream_response(request, clients, settings, a2a_key(task_id), owns)


@router.get("/api/subagents/{subagent_id}/stream", responses=STREAM, openapi_extra=RESUME_PARAMETERS)
async def subagent_stream(
    subagent_id: SubagentId,
    request: Request,
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients_dep),
    settings: MeshSettings = Depends(deps.settings_dep),
) -> Response:
    """The live text of one subagent card (`no-buffer` while it is still queued)."""

    async def owns() -> bool:
        request_ = sbs.GetSubagentSessionRequest(subagent_id=subagent_id)
        return await _found(clients.subagents.GetSubagentSession(request_))

    return await stream_response(request, clients, settings, subagent_key(subagent_id), owns)


async def _found(call: grpc.aio.UnaryUnaryCall) -> bool:  # type: ignore[type-arg]
    """True when the owner-checked lookup finds the row (NOT_FOUND covers somebody else's)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise
    return True
