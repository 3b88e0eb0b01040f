"""SubagentService: a thin gRPC adapter from protobuf to the SubagentHandler, errors through the one
table (libs/errors.py). The acting user comes from the call's verified identity, never from the request."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from agentmesh.libs.errors import grpc_errors
from agentmesh.libs.identity import current_user
from agentmesh.services.trace.handlers.subagents import SubagentHandler
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import subagent_service_pb2_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext


class SubagentServicer(subagent_service_pb2_grpc.SubagentServiceServicer):
    def __init__(self, subagents: SubagentHandler) -> None:
        self.subagents = subagents

    @grpc_errors
    async def CreateSubagentSessions(
        self, request: sbs.CreateSubagentSessionsRequest, context: Ctx
    ) -> sbs.CreateSubagentSessionsResponse:
        turns = [(t.user_message, t.assistant_message) for t in request.turns]
        rows, begun = await self.subagents.create(current_user(), request.subagents, turns)
        return sbs.CreateSubagentSessionsResponse(
            subagents=rows,
            turns=[ms.TurnMessages(user_message=u, assistant_message=a) for u, a in begun],
        )

    @grpc_errors
    async def UpdateSubagentSession(
        self, request: sbs.UpdateSubagentSessionRequest, context: Ctx
    ) -> sbs.UpdateSubagentSessionResponse:
        paths = list(request.update_mask.paths)
        row = await self.subagents.update(current_user(), request.subagent, paths)
        return sbs.UpdateSubagentSessionResponse(subagent=row)

    @grpc_errors
    async def UpdateSubagentSessions(
        self, request: sbs.UpdateSubagentSessionsRequest, context: Ctx
    ) -> sbs.UpdateSubagentSessionsResponse:
        updates = [(u.subagent, list(u.update_mask.paths)) for u in request.updates]
        rows = await self.subagents.update_many(current_user(), updates)
        return sbs.UpdateSubagentSessionsResponse(subagents=rows)

    @grpc_errors
    async def GetSubagentSession(
        self, request: sbs.GetSubagentSessionRequest, context: Ctx
    ) -> sbs.GetSubagentSessionResponse:
        row = await self.subagents.get(current_user(), request.subagent_id)
        return sbs.GetSubagentSessionResponse(subagent=row)

    @grpc_errors
    async def ListSubagentSessions(
        self, request: sbs.ListSubagentSessionsRequest, context: Ctx
    ) -> sbs.ListSubagentSessionsResponse:
        rows = await self.subagents.list(current_user(), request.trace_id, request.parent_message_id)
        return sbs.ListSubagentSessionsResponse(subagents=rows)
