"""TraceService: a thin gRPC adapter over TraceStore."""

from __future__ import annotations

from typing import TypeAlias

import grpc
from google.protobuf import json_format

from agentmesh.v1 import trace_service_pb2 as ts
from agentmesh.v1 import trace_service_pb2_grpc
from libs.errors import grpc_errors
from services.trace.store import TraceStore

Ctx: TypeAlias = grpc.aio.ServicerContext


class TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, store: TraceStore) -> None:
        self.store = store

    @grpc_errors
    async def CreateSession(self, request: ts.CreateSessionRequest, context: Ctx) -> ts.CreateSessionResponse:
        session = await self.store.create_session(
            request.owner,
            request.agent,
            request.kind,
            request.title,
            request.visible_in_sidebar,
            request.session_id,
        )
        return ts.CreateSessionResponse(session=session)

    @grpc_errors
    async def GetSession(self, request: ts.GetSessionRequest, context: Ctx) -> ts.GetSessionResponse:
        return ts.GetSessionResponse(session=await self.store.get_session(request.owner, request.session_id))

    @grpc_errors
    async def ListSessions(self, request: ts.ListSessionsRequest, context: Ctx) -> ts.ListSessionsResponse:
        sessions, token = await self.store.list_sessions(request.owner, request.page_size, request.page_token)
        return ts.ListSessionsResponse(sessions=sessions, next_page_token=token)

    @grpc_errors
    async def UpdateSession(self, request: ts.UpdateSessionRequest, context: Ctx) -> ts.UpdateSessionResponse:
        session = await self.store.update_session(
            request.owner,
            request.session_id,
            request.title,
            request.visible_in_sidebar,
            list(request.update_mask.paths),
        )
        return ts.UpdateSessionResponse(session=session)

    @grpc_errors
    async def DeleteSession(self, request: ts.DeleteSessionRequest, context: Ctx) -> ts.DeleteSessionResponse:
        await self.store.delete_session(request.owner, request.session_id)
        return ts.DeleteSessionResponse()

    @grpc_errors
    async def DeleteSessions(
        self, request: ts.DeleteSessionsRequest, context: Ctx
    ) -> ts.DeleteSessionsResponse:
        return ts.DeleteSessionsResponse(deleted_count=await self.store.delete_sessions(request.owner))

    @grpc_errors
    async def AppendMessage(self, request: ts.AppendMessageRequest, context: Ctx) -> ts.AppendMessageResponse:
        parent = request.parent_sequence if request.HasField("parent_sequence") else None
        message = await self.store.append_message(request.owner, request.message, parent)
        return ts.AppendMessageResponse(message=message)

    @grpc_errors
    async def UpdateMessage(self, request: ts.UpdateMessageRequest, context: Ctx) -> ts.UpdateMessageResponse:
        message = await self.store.update_message(
            request.owner, request.message, list(request.update_mask.paths)
        )
        return ts.UpdateMessageResponse(message=message)

    @grpc_errors
    async def ListMessages(self, request: ts.ListMessagesRequest, context: Ctx) -> ts.ListMessagesResponse:
        messages, head, total = await self.store.list_messages(
            request.owner,
            request.session_id,
            request.mode,
            request.head_sequence,
            request.since_sequence,
            request.limit,
            request.offset,
        )
        return ts.ListMessagesResponse(messages=messages, head_sequence=head, total=total)

    @grpc_errors
    async def SetHead(self, request: ts.SetHeadRequest, context: Ctx) -> ts.SetHeadResponse:
        session = await self.store.set_head(request.owner, request.session_id, request.head_sequence)
        return ts.SetHeadResponse(session=session)

    @grpc_errors
    async def GetTrace(self, request: ts.GetTraceRequest, context: Ctx) -> ts.GetTraceResponse:
        session, count, path_count = await self.store.get_trace(request.owner, request.session_id)
        return ts.GetTraceResponse(session=session, message_count=count, main_path_count=path_count)

    @grpc_errors
    async def CreateA2ATask(self, request: ts.CreateA2ATaskRequest, context: Ctx) -> ts.CreateA2ATaskResponse:
        task = await self.store.create_a2a_task(
            request.owner,
            request.callee_agent,
            request.caller_agent,
            request.caller_session_id,
            json_format.MessageToDict(request.caller_context) if request.HasField("caller_context") else None,
            request.visible_in_sidebar,
            request.continue_session_id,
        )
        return ts.CreateA2ATaskResponse(task=task)

    @grpc_errors
    async def UpdateA2ATask(self, request: ts.UpdateA2ATaskRequest, context: Ctx) -> ts.UpdateA2ATaskResponse:
        task = await self.store.update_a2a_task(request.owner, request.task_id, request.state)
        return ts.UpdateA2ATaskResponse(task=task)

    @grpc_errors
    async def GetA2ATask(self, request: ts.GetA2ATaskRequest, context: Ctx) -> ts.GetA2ATaskResponse:
        return ts.GetA2ATaskResponse(task=await self.store.get_a2a_task(request.owner, request.task_id))

    @grpc_errors
    async def ListA2ATasks(self, request: ts.ListA2ATasksRequest, context: Ctx) -> ts.ListA2ATasksResponse:
        tasks = await self.store.list_a2a_tasks(request.owner, request.caller_session_id)
        return ts.ListA2ATasksResponse(tasks=tasks)

    @grpc_errors
    async def CreateSubagentSession(
        self, request: ts.CreateSubagentSessionRequest, context: Ctx
    ) -> ts.CreateSubagentSessionResponse:
        subagent = await self.store.create_subagent(request.owner, request.subagent)
        return ts.CreateSubagentSessionResponse(subagent=subagent)

    @grpc_errors
    async def UpdateSubagentSession(
        self, request: ts.UpdateSubagentSessionRequest, context: Ctx
    ) -> ts.UpdateSubagentSessionResponse:
        subagent = await self.store.update_subagent(
            request.owner, request.subagent, list(request.update_mask.paths)
        )
        return ts.UpdateSubagentSessionResponse(subagent=subagent)

    @grpc_errors
    async def GetSubagentSession(
        self, request: ts.GetSubagentSessionRequest, context: Ctx
    ) -> ts.GetSubagentSessionResponse:
        return ts.GetSubagentSessionResponse(
            subagent=await self.store.get_subagent(request.owner, request.subagent_id)
        )

    @grpc_errors
    async def ListSubagentSessions(
        self, request: ts.ListSubagentSessionsRequest, context: Ctx
    ) -> ts.ListSubagentSessionsResponse:
        rows = await self.store.list_subagents(request.owner, request.session_id, request.parent_message_id)
        return ts.ListSubagentSessionsResponse(subagents=rows)

    @grpc_errors
    async def AuthenticateApiKey(
        self, request: ts.AuthenticateApiKeyRequest, context: Ctx
    ) -> ts.AuthenticateApiKeyResponse:
        return ts.AuthenticateApiKeyResponse(user=await self.store.authenticate(request.api_key))

    @grpc_errors
    async def CreateApiKey(self, request: ts.CreateApiKeyRequest, context: Ctx) -> ts.CreateApiKeyResponse:
        key = await self.store.create_api_key(request.user)
        return ts.CreateApiKeyResponse(api_key=key, user=request.user)
