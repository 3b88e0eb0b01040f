"""Session routes: list, read, rename and delete sessions, and read their messages (TraceService)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from google.protobuf import field_mask_pb2
from pydantic import BaseModel, ConfigDict, Field

from agentmesh.gateway.deps import clients, current_user
from agentmesh.gateway.errors import AUTH, READ, WRITE, responses
from agentmesh.gateway.openapi import INTEGER, MESSAGE, SESSION, obj, ok, session_links
from agentmesh.gateway.params import NO_NUL, PageToken, SessionId
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import rpc
from agentmesh.libs.protojson import to_json
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

router = APIRouter(prefix="/api/sessions", tags=["sessions"])

User = Annotated[str, Depends(current_user)]
MODES = {"main_path": ms.PATH_MODE_MAIN_PATH, "all": ms.PATH_MODE_ALL}


class SessionPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    title: str = Field(min_length=1, max_length=500, pattern=NO_NUL)


@router.get(
    "",
    responses={
        **ok(
            obj(sessions={"type": "array", "items": SESSION}, nextPageToken={"type": "string"}),
            links=session_links("/sessions/0/id"),
        ),
        **responses(*AUTH, 422),
    },
)
async def list_sessions(
    request: Request,
    user: User,
    page_size: Annotated[int, Query(ge=0, le=200, description="0: the default (50)")] = 0,
    page_token: PageToken = "",
) -> dict[str, Any]:
    """The caller's sessions, most recently active first: {"sessions": [...], "nextPageToken": "..."}."""
    resp = await rpc(
        clients(request).trace.ListTraces(ts.ListTracesRequest(page_size=page_size, page_token=page_token))
    )
    return {"sessions": [to_json(s) for s in resp.traces], "nextPageToken": resp.next_page_token}


@router.get(
    "/{session_id}",
    responses={
        **ok(
            obj(session=SESSION, messageCount=INTEGER, mainPathCount=INTEGER),
            links=session_links("/session/id"),
        ),
        **responses(*READ),
    },
)
async def get_session(request: Request, user: User, session_id: SessionId) -> dict[str, Any]:
    """{"session": {...}, "messageCount": n, "mainPathCount": n}."""
    resp = await rpc(
        clients(request).trace.GetTrace(ts.GetTraceRequest(trace_id=session_id, view=ts.TRACE_VIEW_FULL))
    )
    return {
        "session": to_json(resp.trace),
        "messageCount": resp.message_count,
        "mainPathCount": resp.main_path_count,
    }


@router.patch(
    "/{session_id}",
    responses={**ok(obj(session=SESSION), links=session_links("/session/id")), **responses(*WRITE)},
)
async def rename_session(
    request: Request, user: User, session_id: SessionId, body: SessionPatch
) -> dict[str, Any]:
    """Renames a session: {"title": "..."} -> {"session": {...}}."""
    resp = await rpc(
        clients(request).trace.UpdateTrace(
            ts.UpdateTraceRequest(
                trace=tp.Trace(id=session_id, title=body.title),
                update_mask=field_mask_pb2.FieldMask(paths=["title"]),
            )
        )
    )
    return {"session": to_json(resp.trace)}


@router.delete("/{session_id}", responses={**ok(obj(deleted={"const": True})), **responses(*READ)})
async def delete_session(request: Request, user: User, session_id: SessionId) -> dict[str, bool]:
    """Deletes the session and everything under it; a running turn stops and its streams end."""
    await rpc(clients(request).orchestrator.DeleteTrace(orc.DeleteTraceRequest(trace_id=session_id)))
    return {"deleted": True}


@router.delete("", responses={**ok(obj(deletedCount=INTEGER)), **responses(*AUTH)})
async def delete_sessions(request: Request, user: User) -> dict[str, int]:
    """Deletes all of the caller's sessions: {"deletedCount": n} (traces of every kind)."""
    resp = await rpc(clients(request).orchestrator.DeleteTraces(orc.DeleteTracesRequest()))
    return {"deletedCount": resp.deleted_traces}


@router.get(
    "/{session_id}/messages",
    responses={
        **ok(obj(messages={"type": "array", "items": MESSAGE}, headSequence=INTEGER, total=INTEGER)),
        **responses(*READ),
    },
)
async def list_messages(
    request: Request,
    user: User,
    session_id: SessionId,
    mode: Literal["main_path", "all"] = "main_path",
    head_sequence: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    since_sequence: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    limit: Annotated[int, Query(ge=0, le=1000, description="0: the default (100)")] = 0,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> dict[str, Any]:
    """{"messages": [...], "headSequence": n, "total": n}; mode main_path (default) or all. Subagent
    batches are restored from their rows where an assistant message's metadata lacks them."""
    _, page = await messages_page(
        clients(request), session_id, mode, head_sequence, since_sequence, limit, offset
    )
    return page


async def messages_page(
    clients: Clients,
    trace_id: str,
    mode: str,
    head_sequence: int,
    since_sequence: int,
    limit: int,
    offset: int,
) -> tuple[ms.ListMessagesResponse, dict[str, Any]]:
    """One page of a trace's messages (the trace service's answer, and its JSON: messages,
    headSequence, total): the sessions API and the trace API read messages alike."""
    resp = await rpc(
        clients.messages.ListMessages(
            ms.ListMessagesRequest(
                trace_id=trace_id,
                mode=MODES[mode],
                head_sequence=head_sequence,
                since_sequence=since_sequence,
                limit=limit,
                offset=offset,
                view=ms.MESSAGE_VIEW_FULL,
            )
        )
    )
    page = {
        "messages": [to_json(m) for m in resp.messages],
        "headSequence": resp.head_sequence,
        "total": resp.total,
    }
    return resp, page
