"""OrchestratorService: a thin adapter over ChatOrchestrator and its turn engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from agentmesh.libs.errors import Internal, InvalidArgument, grpc_errors
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2_grpc as orc_grpc
from agentmesh.services.orchestrator.chat import ChatOrchestrator


class OrchestratorServicer(orc_grpc.OrchestratorServiceServicer):
    def __init__(self, chat: ChatOrchestrator) -> None:
        self.chat = chat

    @grpc_errors
    async def ExecuteChat(
        self, request: orc.ExecuteChatRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orc.ExecuteChatResponse]:
        turn = self.chat.execute(
            request.agent, request.message, request.session_id, events_from_stream=request.events_from_stream
        )
        async for batch in turn:
            if isinstance(batch, str):  # the buffer session:<id> exists
                yield orc.ExecuteChatResponse(session_id=batch)
            else:
                yield orc.ExecuteChatResponse(events=batch)

    @grpc_errors
    async def ContinueTrace(
        self, request: orc.ContinueTraceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[orc.ContinueTraceResponse]:
        if not request.trace_id:
            raise InvalidArgument("trace_id is required")
        async for batch in self.chat.execute(request.agent, request.input, request.trace_id, any_kind=True):
            assert not isinstance(batch, str)  # said only to a caller that reads the buffer
            yield orc.ContinueTraceResponse(events=batch)

    @grpc_errors
    async def CancelChat(
        self, request: orc.CancelChatRequest, context: grpc.aio.ServicerContext
    ) -> orc.CancelChatResponse:
        return orc.CancelChatResponse(cancelled=await self.chat.cancel(request.session_id))

    @grpc_errors
    async def RunTurn(
        self, request: orc.RunTurnRequest, context: grpc.aio.ServicerContext
    ) -> orc.RunTurnResponse:
        if not request.trace_id or not request.agent or not request.stream_key:
            raise InvalidArgument("trace_id, agent and stream_key are required")
        outcome = await self.chat.run_turn(request)
        resp = orc.RunTurnResponse(
            user_message_id=outcome.user_message.id if outcome.user_message else 0,
            assistant_message_id=outcome.assistant_message.id if outcome.assistant_message else 0,
        )
        if outcome.ok:
            assert outcome.result is not None
            resp.result.CopyFrom(outcome.result)
        else:
            resp.error.CopyFrom((outcome.error or Internal("the turn failed")).to_event())
        return resp

    @grpc_errors
    async def DeleteSession(
        self, request: orc.DeleteSessionRequest, context: grpc.aio.ServicerContext
    ) -> orc.DeleteSessionResponse:
        traces, streams = await self.chat.delete(request.session_id)
        return orc.DeleteSessionResponse(deleted_traces=traces, deleted_streams=streams)

    @grpc_errors
    async def DeleteSessions(
        self, request: orc.DeleteSessionsRequest, context: grpc.aio.ServicerContext
    ) -> orc.DeleteSessionsResponse:
        traces, streams = await self.chat.delete(None)
        return orc.DeleteSessionsResponse(deleted_traces=traces, deleted_streams=streams)
