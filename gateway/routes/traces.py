"""The trace API (docs/requirements.md#trace-api): what other meshes and agents call to
read, append to and continue traces. Thin: TraceService and OrchestratorService over gRPC.

A trace id in these paths is any of the three forms (libs.ids.TraceRef): `abc-123`, `@alias/abc-123`
or `agent://host[:port]/abc-123` (URL-encoded or not); a peer's trace is read through this mesh's
cached copy (`stale: true` when the peer did not answer). Another user's trace answers 404 like a
missing one. Answers are gzip-compressed when the client accepts it (not the SSE of /run).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from fastapi import APIRouter, Depends, Path, Query, Request
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse

from agentmesh.gateway.deps import clients, current_user, settings
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.errors import READ, SSE, WRITE, responses
from agentmesh.gateway.openapi import INTEGER, MESSAGE, TRACE, obj, ok
from agentmesh.gateway.params import MESSAGE_PATTERN, NO_NUL, SLUG_PATTERN, TRACE_ID_PATTERN
from agentmesh.gateway.relay import relay_run
from agentmesh.gateway.routes.sessions import messages_page
from agentmesh.gateway.sse import drain_options, sse_message
from agentmesh.gateway.turns import ended_event, start_turn, turn_events
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, rpc
from agentmesh.libs.ids import MAX_REF, TraceRef
from agentmesh.libs.peer_file import DEFAULT_PORTS
from agentmesh.libs.protojson import from_json, to_json
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

router = APIRouter(prefix="/api/traces", tags=["traces"])
User = Annotated[str, Depends(current_user)]
STALE = {
    "type": "boolean",
    "description": "a peer's trace read from the cached copy: the peer did not answer",
}
AGE = {
    "type": ["number", "null"],
    "minimum": 0,
    "description": "a peer's trace: seconds since the cached copy was last brought up to date",
}
SYNC_TIME = {
    "type": ["string", "null"],
    "format": "date-time",
    "description": "a peer's trace: when the cached copy was last brought up to date",
}

TraceId = Annotated[
    str,
    Path(
        min_length=1,
        max_length=MAX_REF,
        json_schema_extra={"pattern": TRACE_ID_PATTERN},  # checked by the parser, with a clearer message
        description="a trace id: `abc-123` (here), `@alias/abc-123` (a registered peer) or "
        "`agent://host[:port]/abc-123` (a registered peer by address)",
    ),
]


def _ref(trace_id: str, request: Request) -> str:
    """The id checked (a 422 with the reason for a malformed one) and in its canonical spelling; an
    `agent://` id that names this gateway (the address the request came to, or its public URL) is one
    of this mesh's traces."""
    ref = TraceRef.parse(trace_id)
    if ref.host and ref.authority in _own(request):
        return ref.id
    return str(ref)


def _own(request: Request) -> set[str]:
    """This gateway's `host:port` spellings: the request's, and the public URL's when one is set."""
    urls = [str(request.base_url), settings(request).a2a.public_url]
    own = set()
    for url in filter(None, urls):
        parts = urlsplit(url)
        if parts.hostname:
            port = parts.port or DEFAULT_PORTS.get(parts.scheme, 0)
            host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
            own.add(f"{host.lower()}:{port}")
            if port == DEFAULT_PORTS.get(parts.scheme):
                own.add(host.lower())  # agent://host/<id>: the scheme's default port
    return own


class MessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant", "system"]
    content: str = Field(max_length=100_000, pattern=NO_NUL)
    thinking: str = Field(default="", max_length=100_000, pattern=NO_NUL)
    metadata: dict[str, Any] = Field(default_factory=dict)
    model: str = Field(default="", max_length=200, pattern=NO_NUL)
    status: Literal["completed", "failed", "cancelled"] = "completed"
    source: Literal["user", "a2a", "subagent"] = "user"
    usage: dict[Literal["inputTokens", "outputTokens"], Annotated[int, Field(ge=0, le=2**53)]] = Field(
        default_factory=dict
    )


class AppendBody(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    messages: list[MessageIn] = Field(min_length=1, max_length=100)
    parent_sequence: int | None = Field(default=None, alias="parentSequence", ge=0, le=2**63 - 1)


class RunBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str = Field(min_length=1, max_length=100_000, json_schema_extra={"pattern": MESSAGE_PATTERN})
    agent: str = Field(default="", max_length=100, pattern=f"^(?:{SLUG_PATTERN})?$")


def _message(m: MessageIn) -> tp.Message:
    try:
        msg = from_json(m.model_dump(), tp.Message())
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"invalid message: {exc}") from exc
    return msg  # type: ignore[return-value]


@router.get(
    "/{trace_id:path}/messages",
    responses={
        **ok(
            obj(
                messages={"type": "array", "items": MESSAGE},
                headSequence=INTEGER,
                total=INTEGER,
                stale=STALE,
                syncTime=SYNC_TIME,
                ageS=AGE,
            )
        ),
        **responses(*READ, 403),
    },
)
async def list_messages(
    request: Request,
    user: User,
    trace_id: TraceId,
    mode: Literal["main_path", "all"] = "main_path",
    head_sequence: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    since_sequence: Annotated[int, Query(ge=0, le=2**63 - 1, description="only after this sequence")] = 0,
    limit: Annotated[int, Query(ge=0, le=1000, description="0: the default (100)")] = 0,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> dict[str, Any]:
    """{"messages": [...], "headSequence": n, "total": n, "stale": bool, "syncTime", "ageS"}: the main path
    (from the head, or head_sequence) or every branch, by sequence, after since_sequence, paged."""
    resp, page = await messages_page(
        clients(request), _ref(trace_id, request), mode, head_sequence, since_sequence, limit, offset
    )
    return {
        **page,
        "stale": resp.stale,
        **_sync(resp.sync_time if resp.HasField("sync_time") else None),
    }


@router.post(
    "/{trace_id:path}/messages",
    responses={**ok(obj(messages={"type": "array", "items": MESSAGE})), **responses(*WRITE, 403, 409)},
)
async def append_messages(
    request: Request, user: User, trace_id: TraceId, body: AppendBody
) -> dict[str, Any]:
    """Appends finished messages after the head (or parentSequence), all or none:
    {"messages": [{"role": "user", "content": "..."}, ...]} -> {"messages": [stored, with ids]}. A
    peer's trace is appended to at its home, or not at all (503 when the peer does not answer)."""
    messages = [_message(m) for m in body.messages]
    req = ms.AppendMessagesRequest(trace_id=_ref(trace_id, request), messages=messages)
    if body.parent_sequence is not None:
        req.parent_sequence = body.parent_sequence
    resp = await rpc(clients(request).messages.AppendMessages(req))
    return {"messages": [to_json(m) for m in resp.messages]}


RUN_RESULT = obj(
    traceId={"type": "string"},
    ok={"type": "boolean"},
    output={"type": "string"},
    messageId=INTEGER,
    error={"type": ["object", "null"]},
)


@router.post(
    "/{trace_id:path}/run",
    response_model=None,
    responses={
        200: {
            "description": "the turn's result as JSON, or its events as SSE with Accept: text/event-stream",
            "content": {"application/json": {"schema": RUN_RESULT}, **SSE["content"]},
        },
        **responses(*WRITE, 403, 409, 429),
    },
)
async def run(
    request: Request, user: User, trace_id: TraceId, body: RunBody
) -> dict[str, Any] | EventSourceResponse:
    """Continues the trace: its agent (or `agent`) runs one turn on `input`, appended to the trace.
    With `Accept: text/event-stream` the turn's events stream as SSE (as POST /api/chat); otherwise
    the answer waits for the end: {"traceId", "ok", "output", "messageId", "error"}. A peer's trace
    is continued at its home (its /run), relayed."""
    tid = _ref(trace_id, request)
    if not body.input.strip():
        raise InvalidArgument("input must not be empty")
    c: Clients = clients(request)
    mesh = settings(request)
    wants_sse = "text/event-stream" in request.headers.get("accept", "")
    ref = TraceRef.parse(tid)
    if not ref.is_local:  # a peer's trace: continued at its home
        relayed = {"input": body.input, **({"agent": body.agent} if body.agent else {})}
        return await relay_run(c, ref, relayed, wants_sse, mesh.stream.heartbeat_s)
    request_turn = orc.RunTurnRequest(trace_id=tid, input=body.input, agent=body.agent, chat=orc.ChatCaller())
    turn = await start_turn(c, request_turn)
    if wants_sse:
        drain: Drain = request.app.state.drain

        async def stream() -> AsyncIterator[bytes]:
            async for event in turn_events(c, turn, drain):
                yield sse_message(event)

        return EventSourceResponse(stream(), ping=mesh.stream.heartbeat_s, **drain_options(mesh))
    try:
        ended = await turn.ended
    finally:
        turn.close()
    error = None
    if ended is None or ended.HasField("error"):
        failure = events.to_dict(ended_event(ended))
        error = {"code": failure.get("code", ""), "message": failure.get("message", "")}
    return {
        "traceId": tid,
        "ok": error is None,
        "output": ended.message.content if ended is not None else "",
        "messageId": turn.begun.start.start.assistant_message_id,
        "error": error,
    }


@router.get(
    "/{trace_id:path}",
    responses={
        **ok(
            obj(
                trace=TRACE,
                messageCount=INTEGER,
                mainPathCount=INTEGER,
                stale=STALE,
                syncTime=SYNC_TIME,
                ageS=AGE,
            )
        ),
        **responses(*READ, 403),
    },
)
async def get_trace(request: Request, user: User, trace_id: TraceId) -> dict[str, Any]:
    """{"trace": {...}, "messageCount": n, "mainPathCount": n, "stale": bool, "syncTime", "ageS"}."""
    resp = await rpc(
        clients(request).trace.GetTrace(
            ts.GetTraceRequest(trace_id=_ref(trace_id, request), view=ts.TRACE_VIEW_FULL)
        )
    )
    t = resp.trace
    return {
        "trace": to_json(t),
        "messageCount": resp.message_count,
        "mainPathCount": resp.main_path_count,
        "stale": t.stale,
        **_sync(t.sync_time if t.HasField("sync_time") else None),
    }


def _sync(stamp: Any) -> dict[str, Any]:
    """syncTime and ageS of a peer's trace (None for a trace of this mesh)."""
    if stamp is None:
        return {"syncTime": None, "ageS": None}
    age = (datetime.now(UTC) - stamp.ToDatetime(tzinfo=UTC)).total_seconds()
    return {"syncTime": to_json(stamp), "ageS": round(max(age, 0.0), 3)}
