"""Resumable live streams: a session's running turn, an agent-invoke callee (a2a task), a subagent card."""

from __future__ import annotations

import grpc
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from agentmesh.trace.v1 import trace_service_pb2 as ts
from gateway import deps
from gateway.sse import stream_response
from libs.clients import Clients
from libs.config import MeshSettings
from libs.ids import a2a_key, session_key, subagent_key

router = APIRouter(tags=["streams"])


@router.get("/api/sessions/{session_id}/stream")
async def session_stream(
    session_id: str,
    request: Request,
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients),
    settings: MeshSettings = Depends(deps.settings),
) -> Response:
    """Resumes the live turn of a session (SSE, replay then live)."""

    async def owns() -> bool:
        return await _found(clients.trace.GetTrace(ts.GetTraceRequest(trace_id=session_id)))

    return await stream_response(request, clients, settings, session_key(session_id), owns)


@router.get("/api/agents/a2a/stream")
async def a2a_stream(
    request: Request,
    task_id: str = Query(alias="taskId", min_length=1),
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients),
    settings: MeshSettings = Depends(deps.settings),
) -> Response:
    """The callee's live reply of an agent-invoke call, readable by the caller session's owner."""

    async def owns() -> bool:
        return await _found(clients.trace.GetA2ATask(ts.GetA2ATaskRequest(task_id=task_id)))

    return await stream_response(request, clients, settings, a2a_key(task_id), owns)


@router.get("/api/subagents/{subagent_id}/stream")
async def subagent_stream(
    subagent_id: str,
    request: Request,
    user: str = Depends(deps.current_user),
    clients: Clients = Depends(deps.clients),
    settings: MeshSettings = Depends(deps.settings),
) -> Response:
    """The live text of one subagent card (`no-buffer` while it is still queued)."""

    async def owns() -> bool:
        request_ = ts.GetSubagentSessionRequest(subagent_id=subagent_id)
        return await _found(clients.trace.GetSubagentSession(request_))

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
