"""OrchestratorService: a thin adapter over ChatOrchestrator."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from agentmesh.v1 import orchestrator_service_pb2 as orc
from agentmesh.v1 import orchestrator_service_pb2_grpc as orc_grpc
from libs.errors import grpc_errors
from services.orchestrator.chat import ChatOrchestrator


class OrchestratorServicer(orc_grpc.OrchestratorServiceServicer):
    def __init__(self, chat: ChatOrchestrator) -> None:
        self.chat = chat

    @grpc_errors
    async def ExecuteChat(
        self, request: orc.ExecuteChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orc.ExecuteChatResponse]:
        async for batch in self.chat.execute(
            request.owner, request.agent, request.message, request.session_id
        ):
            yield orc.ExecuteChatResponse(events=batch)

    @grpc_errors
    async def CancelChat(
        self, request: orc.CancelChatRequest, context: grpc.aio.ServicerContext
    ) -> orc.CancelChatResponse:
        return orc.CancelChatResponse(cancelled=await self.chat.cancel(request.owner, request.session_id))
