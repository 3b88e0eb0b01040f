"""AgentService, AuthService and LeaseService: thin gRPC adapters over the agent handler and the key and
lease stores. Keys and leases are the mesh's own business, never a user's."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.leases.v1 import lease_service_pb2_grpc
from agentmesh.libs.errors import InvalidArgument, PermissionDenied, grpc_errors
from agentmesh.libs.identity import current, current_user
from agentmesh.services.trace.handlers.agents import AgentHandler
from agentmesh.services.trace.store.base import KeyStore, LeaseStore

Ctx: TypeAlias = grpc.aio.ServicerContext


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
