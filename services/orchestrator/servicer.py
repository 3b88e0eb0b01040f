"""OrchestratorService: a thin adapter over the Orchestrator (docs/design/turns.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from agentmesh.libs.errors import InvalidArgument, grpc_errors
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2_grpc as orc_grpc
from agentmesh.services.orchestrator.orchestrator import Orchestrator


class OrchestratorServicer(orc_grpc.OrchestratorServiceServicer):
    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator

    @grpc_errors
    async def RunTurn(
        self, request: orc.RunTurnRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orc.RunTurnResponse]:
        async for response in self.orchestrator.run_turn(request):
            yield response

    @grpc_errors
    async def RunSubagents(
        self, request: orc.RunSubagentsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orc.RunSubagentsResponse]:
        if not request.trace_id or not request.anchor_message_id:
            raise InvalidArgument("trace_id and anchor_message_id are required")
        async for response in self.orchestrator.run_subagents(request):
            yield response

    @grpc_errors
    async def CancelTurn(
        self, request: orc.CancelTurnRequest, context: grpc.aio.ServicerContext
    ) -> orc.CancelTurnResponse:
        return orc.CancelTurnResponse(cancelled=await self.orchestrator.cancel(request))

    @grpc_errors
    async def EndOrphanedTurn(
        self, request: orc.EndOrphanedTurnRequest, context: grpc.aio.ServicerContext
    ) -> orc.EndOrphanedTurnResponse:
        return orc.EndOrphanedTurnResponse(settled=await self.orchestrator.orphans.end(request.stream))

    @grpc_errors
    async def DeleteTrace(
        self, request: orc.DeleteTraceRequest, context: grpc.aio.ServicerContext
    ) -> orc.DeleteTraceResponse:
        traces, streams = await self.orchestrator.delete(request.trace_id)
        return orc.DeleteTraceResponse(deleted_traces=traces, deleted_streams=streams)

    @grpc_errors
    async def DeleteTraces(
        self, request: orc.DeleteTracesRequest, context: grpc.aio.ServicerContext
    ) -> orc.DeleteTracesResponse:
        traces, streams = await self.orchestrator.delete(None)
        return orc.DeleteTracesResponse(deleted_traces=traces, deleted_streams=streams)
