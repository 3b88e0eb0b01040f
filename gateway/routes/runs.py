"""GET /api/runs: the caller's running and recent runs across traces (docs/http-api.md#runs). Thin:
TraceService.ListRuns over gRPC; the filters are its enums by their JSON names."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request

from agentmesh.gateway.deps import clients, current_user
from agentmesh.gateway.errors import AUTH, responses
from agentmesh.gateway.openapi import RUN, obj, ok, session_links
from agentmesh.gateway.params import SLUG_PATTERN, PageToken
from agentmesh.libs.errors import rpc
from agentmesh.libs.protojson import str_to_enum, to_json
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

router = APIRouter(prefix="/api/runs", tags=["runs"])

User = Annotated[str, Depends(current_user)]
State = Literal["running", "done", "failed", "cancelled", "interrupted"]
Kind = Literal["chat", "callee", "subagent", "a2a"]


@router.get(
    "",
    responses={
        **ok(
            obj(runs={"type": "array", "items": RUN}, nextPageToken={"type": "string"}),
            links=session_links("/runs/0/traceId"),
        ),
        **responses(*AUTH, 422),
    },
)
async def list_runs(
    request: Request,
    user: User,
    state: Annotated[State | None, Query(description="only runs in this state")] = None,
    kind: Annotated[Kind | None, Query(description="only runs of this kind")] = None,
    agent: Annotated[
        str, Query(pattern=f"^(?:{SLUG_PATTERN})?$", max_length=100, description="only this agent's runs")
    ] = "",
    page_size: Annotated[int, Query(ge=0, le=200, description="0: the default (50)")] = 0,
    page_token: PageToken = "",
) -> dict[str, Any]:
    """The caller's runs, newest first: {"runs": [...], "nextPageToken": "..."}."""
    resp = await rpc(
        clients(request).trace.ListRuns(
            ts.ListRunsRequest(
                state=str_to_enum(tp.RunState.DESCRIPTOR, state) if state else 0,  # type: ignore[arg-type]
                kind=str_to_enum(tp.RunKind.DESCRIPTOR, kind) if kind else 0,  # type: ignore[arg-type]
                agent=agent,
                page_size=page_size,
                page_token=page_token,
            )
        )
    )
    return {"runs": [to_json(r) for r in resp.runs], "nextPageToken": resp.next_page_token}
