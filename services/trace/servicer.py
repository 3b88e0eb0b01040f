"""TraceService, AgentService, AuthService and LeaseService: thin gRPC adapters from protobuf to the
handlers (services/trace/handlers/), errors through the one table (libs/errors.py). The acting user
comes from the call's verified identity (libs.identity), never from the request; an append of
AppendMessageStream may carry an identity token of its own, verified as the call's is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TypeAlias

import grpc

from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.leases.v1 import lease_service_pb2_grpc
from agentmesh.libs.errors import InvalidArgument, MeshError, PermissionDenied, grpc_errors
from agentmesh.libs.identity import Principal, Signer, current, current_user, user_of
from agentmesh.services.trace.handlers.agents import AgentHandler
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.subagents import SubagentHandler
from agentmesh.services.trace.handlers.tasks import TaskHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.base import (
    Append,
    Deleted,
    InboundTaskQuery,
    KeyStore,
    LeaseStore,
    MessageQuery,
)
from agentmesh.trace.v1 import trace_service_pb2 as ts
from agentmesh.trace.v1 import trace_service_pb2_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext


@dataclass
class Handlers:
    """The trace domain, one handler per resource."""

    traces: TraceHandler
    messages: MessageHandler
    tasks: TaskHandler
    subagents: SubagentHandler


def _deleted(cls: type, d: Deleted) -> object:
    return cls(
        deleted_trace_ids=d.trace_ids, deleted_task_ids=d.task_ids, deleted_subagent_ids=d.subagent_ids
    )


def _parent(append: ts.AppendMessageRequest) -> int | None:
    return append.parent_sequence if append.HasField("parent_sequence") else None


class TraceServicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, handlers: Handlers, signer: Signer) -> None:
        self.traces = handlers.traces
        self.messages = handlers.messages
        self.tasks = handlers.tasks
        self.subagents = handlers.subagents
        self.signer = signer  # the server's (IdentityInterceptor): verifies the tokens of stream appends

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
    async def AppendMessage(self, request: ts.AppendMessageRequest, context: Ctx) -> ts.AppendMessageResponse:
        message = await self.messages.append(current_user(), request.message, _parent(request))
        return ts.AppendMessageResponse(message=message)

    @grpc_errors
    async def AppendMessageStream(
        self, requests: AsyncIterator[ts.AppendMessageStreamRequest], context: Ctx
    ) -> AsyncIterator[ts.AppendMessageStreamResponse]:
        caller = current()  # the stream's verified identity
        async for request in requests:
            if not request.appends:
                append = request.append
                try:
                    message = await self.messages.append(user_of(caller), append.message, _parent(append))
                except MeshError as err:  # this append's error: the stream goes on
                    yield ts.AppendMessageStreamResponse(error_reason=err.reason, error_message=err.message)
                    continue
                yield ts.AppendMessageStreamResponse(message=message)
                continue
            yield await self._append_each(caller, request)

    async def _append_each(
        self, caller: Principal | None, request: ts.AppendMessageStreamRequest
    ) -> ts.AppendMessageStreamResponse:
        """A request of several appends: each as its token's verified user (or the stream's caller),
        handed to the handler together, answered in order (an append that fails fails alone)."""
        if request.HasField("append"):
            raise InvalidArgument("a request carries one append or several appends, not both")

        def verified(item: ts.StreamAppend) -> Append:  # as the server interceptor verifies the call's token
            owner = user_of(self.signer.verify(item.identity) if item.identity else caller)
            return Append(owner, item.append.message, _parent(item.append))

        results = await self.messages.append_each(request.appends, verified)
        resp = ts.AppendMessageStreamResponse()
        for r in results:
            if isinstance(r, MeshError):
                resp.results.add(error_reason=r.reason, error_message=r.message)
            else:
                resp.results.add(message=r)
        return resp

    @grpc_errors
    async def AppendMessages(
        self, request: ts.AppendMessagesRequest, context: Ctx
    ) -> ts.AppendMessagesResponse:
        parent = request.parent_sequence if request.HasField("parent_sequence") else None
        stored = await self.messages.append_finished(
            current_user(), request.trace_id, request.messages, parent
        )
        return ts.AppendMessagesResponse(messages=stored)

    @grpc_errors
    async def BeginTurn(self, request: ts.BeginTurnRequest, context: Ctx) -> ts.BeginTurnResponse:
        return await self.messages.begin_turn(current_user(), request, context.time_remaining())

    @grpc_errors
    async def UpdateMessage(self, request: ts.UpdateMessageRequest, context: Ctx) -> ts.UpdateMessageResponse:
        paths = list(request.update_mask.paths)
        message = await self.messages.update(current_user(), request.message, paths)
        return ts.UpdateMessageResponse(message=message)

    @grpc_errors
    async def GetMessage(self, request: ts.GetMessageRequest, context: Ctx) -> ts.GetMessageResponse:
        return ts.GetMessageResponse(message=await self.messages.get(current_user(), request.message_id))

    @grpc_errors
    async def ListMessages(self, request: ts.ListMessagesRequest, context: Ctx) -> ts.ListMessagesResponse:
        query = MessageQuery(
            trace_id=request.trace_id,
            mode=request.mode,
            head_sequence=request.head_sequence,
            since_sequence=request.since_sequence,
            limit=request.limit,
            offset=request.offset,
        )
        page = await self.messages.list(current_user(), query, request.view)
        resp = ts.ListMessagesResponse(
            messages=page.messages, head_sequence=page.head_sequence, total=page.total, stale=page.stale
        )
        if page.sync_time is not None:
            resp.sync_time.FromDatetime(page.sync_time)
        return resp

    @grpc_errors
    async def CreateA2ATask(self, request: ts.CreateA2ATaskRequest, context: Ctx) -> ts.CreateA2ATaskResponse:
        task = await self.tasks.create(current_user(), request.task, request.continue_trace_id)
        return ts.CreateA2ATaskResponse(task=task)

    @grpc_errors
    async def UpdateA2ATask(self, request: ts.UpdateA2ATaskRequest, context: Ctx) -> ts.UpdateA2ATaskResponse:
        task = await self.tasks.update_state(current_user(), request.task_id, request.state)
        return ts.UpdateA2ATaskResponse(task=task)

    @grpc_errors
    async def GetA2ATask(self, request: ts.GetA2ATaskRequest, context: Ctx) -> ts.GetA2ATaskResponse:
        return ts.GetA2ATaskResponse(task=await self.tasks.get(current_user(), request.task_id))

    @grpc_errors
    async def ListA2ATasks(self, request: ts.ListA2ATasksRequest, context: Ctx) -> ts.ListA2ATasksResponse:
        if request.caller_session_id:
            tasks = await self.tasks.list_started(current_user(), request.caller_session_id)
            return ts.ListA2ATasksResponse(tasks=tasks)
        query = InboundTaskQuery(
            callee_agent=request.callee_agent, trace_id=request.trace_id, state=request.state
        )
        tasks, token = await self.tasks.list_inbound(
            current_user(), query, request.page_size, request.page_token
        )
        return ts.ListA2ATasksResponse(tasks=tasks, next_page_token=token)

    @grpc_errors
    async def CreateSubagentSessions(
        self, request: ts.CreateSubagentSessionsRequest, context: Ctx
    ) -> ts.CreateSubagentSessionsResponse:
        turns = [(t.user_message, t.assistant_message) for t in request.turns]
        rows, begun = await self.subagents.create(current_user(), request.subagents, turns)
        return ts.CreateSubagentSessionsResponse(
            subagents=rows,
            turns=[ts.TurnMessages(user_message=u, assistant_message=a) for u, a in begun],
        )

    @grpc_errors
    async def UpdateSubagentSession(
        self, request: ts.UpdateSubagentSessionRequest, context: Ctx
    ) -> ts.UpdateSubagentSessionResponse:
        paths = list(request.update_mask.paths)
        row = await self.subagents.update(current_user(), request.subagent, paths)
        return ts.UpdateSubagentSessionResponse(subagent=row)

    @grpc_errors
    async def UpdateSubagentSessions(
        self, request: ts.UpdateSubagentSessionsRequest, context: Ctx
    ) -> ts.UpdateSubagentSessionsResponse:
        updates = [(u.subagent, list(u.update_mask.paths)) for u in request.updates]
        rows = await self.subagents.update_many(current_user(), updates)
        return ts.UpdateSubagentSessionsResponse(subagents=rows)

    @grpc_errors
    async def GetSubagentSession(
        self, request: ts.GetSubagentSessionRequest, context: Ctx
    ) -> ts.GetSubagentSessionResponse:
        row = await self.subagents.get(current_user(), request.subagent_id)
        return ts.GetSubagentSessionResponse(subagent=row)

    @grpc_errors
    async def ListSubagentSessions(
        self, request: ts.ListSubagentSessionsRequest, context: Ctx
    ) -> ts.ListSubagentSessionsResponse:
        rows = await self.subagents.list(current_user(), request.trace_id, request.parent_message_id)
        return ts.ListSubagentSessionsResponse(subagents=rows)


class AgentServicer(agent_service_pb2_grpc.AgentServiceServicer):
    def __init__(self, agents: AgentHandler) -> None:
        self.h = agents

    @grpc_errors
    async def GetAgent(self, request: ag.GetAgentRequest, context: Ctx) -> ag.GetAgentResponse:
        return ag.GetAgentResponse(agent=await self.h.get(current_user(), request.slug))

    @grpc_errors
    async def ListAgents(self, request: ag.ListAgentsRequest, context: Ctx) -> ag.ListAgentsResponse:
        return ag.ListAgentsResponse(agents=await self.h.list(current_user()))

    @grpc_errors
    async def CreateAgent(self, request: ag.CreateAgentRequest, context: Ctx) -> ag.CreateAgentResponse:
        paths = list(request.field_mask.paths)
        return ag.CreateAgentResponse(agent=await self.h.create(current_user(), request.agent, paths))

    @grpc_errors
    async def UpdateAgent(self, request: ag.UpdateAgentRequest, context: Ctx) -> ag.UpdateAgentResponse:
        agent = await self.h.update(
            current_user(), request.agent, list(request.update_mask.paths), request.expected_version
        )
        return ag.UpdateAgentResponse(agent=agent)

    @grpc_errors
    async def DeleteAgent(self, request: ag.DeleteAgentRequest, context: Ctx) -> ag.DeleteAgentResponse:
        await self.h.delete(current_user(), request.slug, request.expected_version)
        return ag.DeleteAgentResponse()

    @grpc_errors
    async def CloneAgent(self, request: ag.CloneAgentRequest, context: Ctx) -> ag.CloneAgentResponse:
        agent = await self.h.clone(current_user(), request.slug, request.new_slug, request.name)
        return ag.CloneAgentResponse(agent=agent)

    @grpc_errors
    async def GetAgentOptions(
        self, request: ag.GetAgentOptionsRequest, context: Ctx
    ) -> ag.GetAgentOptionsResponse:
        return await self.h.options(current_user())


def _mesh_only(what: str = "API keys are managed") -> None:
    """Keys and leases are the mesh's business (the gateway checking a key, `agentmesh keys create`, the
    runners renewing leases, a reaper), never a user's: a call acting for a user is refused."""
    principal = current()
    if principal is None or not principal.is_mesh:
        raise PermissionDenied(f"{what} by the mesh itself, not on behalf of a user")


class AuthServicer(auth_service_pb2_grpc.AuthServiceServicer):
    """Called by the mesh itself (the gateway checking a key, `agentmesh keys create`)."""

    def __init__(self, keys: KeyStore) -> None:
        self.keys = keys

    @grpc_errors
    async def AuthenticateApiKey(
        self, request: au.AuthenticateApiKeyRequest, context: Ctx
    ) -> au.AuthenticateApiKeyResponse:
        _mesh_only()
        return au.AuthenticateApiKeyResponse(user=await self.keys.authenticate(request.api_key))

    @grpc_errors
    async def CreateApiKey(self, request: au.CreateApiKeyRequest, context: Ctx) -> au.CreateApiKeyResponse:
        _mesh_only()
        return au.CreateApiKeyResponse(
            api_key=await self.keys.create_api_key(request.user), user=request.user
        )


class LeaseServicer(lease_service_pb2_grpc.LeaseServiceServicer):
    """Called by the mesh itself: runners renew their leases, reapers settle what expired ones left."""

    def __init__(self, leases: LeaseStore) -> None:
        self.leases = leases

    @grpc_errors
    async def RenewLeases(self, request: ls.RenewLeasesRequest, context: Ctx) -> ls.RenewLeasesResponse:
        _mesh_only("leases are kept")
        renewed = await self.leases.renew(request.message_ids, request.task_ids, request.subagent_ids)
        return ls.RenewLeasesResponse(renewed=renewed)

    @grpc_errors
    async def ReapExpired(self, request: ls.ReapExpiredRequest, context: Ctx) -> ls.ReapExpiredResponse:
        _mesh_only("leases are kept")
        if request.limit < 0:
            raise InvalidArgument("limit must not be negative")
        reaped = await self.leases.reap(request.limit or 100)
        return ls.ReapExpiredResponse(
            stream_keys=reaped.stream_keys,
            messages=reaped.messages,
            tasks=reaped.tasks,
            subagents=reaped.subagents,
        )
