"""Session routes: list, read, delete sessions and read their messages (TraceService underneath)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from agentmesh.v1 import trace_pb2
from agentmesh.v1 import trace_service_pb2 as ts
from gateway.deps import clients, current_user
from libs import subagent_batches
from libs.protojson import to_json

router = APIRouter(prefix="/api/sessions", tags=["sessions"])

User = Annotated[str, Depends(current_user)]
_MODES = {"main_path": trace_pb2.LIST_MODE_MAIN_PATH, "all": trace_pb2.LIST_MODE_ALL}


@router.get("")
async def list_sessions(
    request: Request,
    user: User,
    page_size: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
    page_token: str = "",
) -> dict[str, Any]:
    """The caller's sessions, newest first: {"sessions": [...], "nextPageToken": "..."}."""
    resp = await clients(request).trace.ListSessions(
        ts.ListSessionsRequest(owner=user, page_size=page_size, page_token=page_token)
    )
    return {"sessions": [to_json(s) for s in resp.sessions], "nextPageToken": resp.next_page_token}


@router.get("/{session_id}")
async def get_session(request: Request, user: User, session_id: str) -> dict[str, Any]:
    """{"session": {...}, "messageCount": n, "mainPathCount": n}."""
    resp = await clients(request).trace.GetTrace(ts.GetTraceRequest(owner=user, session_id=session_id))
    return {
        "session": to_json(resp.session),
        "messageCount": resp.message_count,
        "mainPathCount": resp.main_path_count,
    }


@router.delete("/{session_id}")
async def delete_session(request: Request, user: User, session_id: str) -> dict[str, bool]:
    """Deletes the session and everything under it."""
    await clients(request).trace.DeleteSession(ts.DeleteSessionRequest(owner=user, session_id=session_id))
    return {"deleted": True}


@router.delete("")
async def delete_sessions(request: Request, user: User) -> dict[str, int]:
    """Deletes all of the caller's sessions: {"deletedCount": n}."""
    resp = await clients(request).trace.DeleteSessions(ts.DeleteSessionsRequest(owner=user))
    return {"deletedCount": resp.deleted_count}


@router.get("/{session_id}/messages")
async def list_messages(
    request: Request,
    user: User,
    session_id: str,
    mode: Literal["main_path", "all"] = "main_path",
    head_sequence: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    since_sequence: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=-(2**31), le=2**31 - 1)] = 0,
    offset: Annotated[int, Query(ge=-(2**31), le=2**31 - 1)] = 0,
) -> dict[str, Any]:
    """{"messages": [...], "headSequence": n, "total": n}; mode main_path (default) or all."""
    resp = await clients(request).trace.ListMessages(
        ts.ListMessagesRequest(
            owner=user,
            session_id=session_id,
            mode=_MODES[mode],
            head_sequence=head_sequence,
            since_sequence=since_sequence,
            limit=limit,
            offset=offset,
        )
    )
    messages = [to_json(m) for m in resp.messages]
    if any(m["role"] == "assistant" and "subagents" not in m.get("metadata", {}) for m in messages):
        rows = await clients(request).trace.ListSubagentSessions(
            ts.ListSubagentSessionsRequest(owner=user, session_id=session_id)
        )
        subagent_batches.restore(messages, rows.subagents)
    return {
        "messages": messages,
        "headSequence": resp.head_sequence,
        "total": resp.total,
    }
