"""TraceService: a thin gRPC adapter from protobuf to the TraceHandler, errors through the one table
(libs/errors.py). The acting user comes from the call's verified identity, never from the request."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from agentmesh.libs.errors import grpc_errors
from agentmesh.libs.identity import current_user
from agentmesh.services.trace.handlers.runs import RunHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.base import Deleted, RunQuery
from agentmesh.trace.v1 import trace_service_pb2 as ts
from agentmesh.trace.v1 import trace_service_pb2_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext


def _deleted(cls: type, d: Deleted) -> object:
    return cls(
        deleted_trace_ids=d.trace_ids, deleted_task_ids=d.task_ids, deleted_subagent_ids=d.subagent_ids
    )


class TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, traces: TraceHandler, runs: RunHandler) -> None:
        self.traces = traces
        self.runs = runs

    @grpc_errors
    async def CreateTrace(self, request: ts.CreateTraceRequest, context: Ctx) -> ts.CreateTraceResponse:
        trace = await self.traces.create(current_user(), request.trace, request.trace_id)
        return ts.CreateTraceResponse(trace=trace)

    @grpc_errors
    async def GetTrace(self, request: ts.GetTraceRequest, context: Ctx) -> ts.GetTraceResponse:
        full = request.view == ts.TRACE_VIEW_FULL
        trace, (count, path) = await self.traces.get(current_user(), request.trace_id, counts=full)
        if not full:
            return ts.GetTraceResponse(trace=trace)
        return ts.GetTraceResponse(trace=trace, message_count=count, main_path_count=path)

    @grpc_errors
    async def ListTraces(self, request: ts.ListTracesRequest, context: Ctx) -> ts.ListTracesResponse:
        traces, token = await self.traces.list(current_user(), request.page_size, request.page_token)
        return ts.ListTracesResponse(traces=traces, next_page_token=token)

    @grpc_errors
    async def UpdateTrace(self, request: ts.UpdateTraceRequest, context: Ctx) -> ts.UpdateTraceResponse:
        paths = list(request.update_mask.paths)
        return ts.UpdateTraceResponse(trace=await self.traces.update(current_user(), request.trace, paths))

    @grpc_errors
    async def DeleteTrace(self, request: ts.DeleteTraceRequest, context: Ctx) -> ts.DeleteTraceResponse:
        deleted = await self.traces.delete(current_user(), [request.trace_id])
        return _deleted(ts.DeleteTraceResponse, deleted)  # type: ignore[return-value]

    @grpc_errors
    async def DeleteTraces(self, request: ts.DeleteTracesRequest, context: Ctx) -> ts.DeleteTracesResponse:
        deleted = await self.traces.delete(current_user(), None)
        return _deleted(ts.DeleteTracesResponse, deleted)  # type: ignore[return-value]

    @grpc_errors
    async def SetTraceHead(self, request: ts.SetTraceHeadRequest, context: Ctx) -> ts.SetTraceHeadResponse:
        trace = await self.traces.set_head(current_user(), request.trace_id, request.head_sequence)
        return ts.SetTraceHeadResponse(trace=trace)

    @grpc_errors
    async def ListRuns(self, request: ts.ListRunsRequest, context: Ctx) -> ts.ListRunsResponse:
        query = RunQuery(state=request.state, kind=request.kind, agent=request.agent)
        runs, token = await self.runs.list(current_user(), query, request.page_size, request.page_token)
        return ts.ListRunsResponse(runs=runs, next_page_token=token)
