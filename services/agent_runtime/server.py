"""The agent-runtime process: the model loop, the tool registry, delegation."""

from __future__ import annotations

from agentmesh.runtime.v1 import runtime_service_pb2, runtime_service_pb2_grpc
from libs.clients import Clients
from libs.config import MeshSettings
from libs.identity import Signer, signer_for
from libs.leases import LeaseKeeper
from libs.rpc import Registration, ServiceServer
from services.agent_runtime import builtin_tools
from services.agent_runtime.llm import LLM
from services.agent_runtime.runner import AgentRunner
from services.agent_runtime.servicer import AgentRuntimeServicer
from services.agent_runtime.tools import ToolRegistry


def build_registry() -> ToolRegistry:
    registry = ToolRegistry()
    builtin_tools.register_all(registry)
    return registry


async def build(
    settings: MeshSettings, address: str | None = None, signer: Signer | None = None
) -> ServiceServer:
    signer = signer or signer_for(settings)
    clients = Clients(settings, signer)
    llm = LLM(settings.llm)
    leases = LeaseKeeper(clients, settings.lease_s)
    runner = AgentRunner(settings, clients, llm, build_registry(), leases)
    server = ServiceServer(
        [
            Registration.of(
                runtime_service_pb2,
                "AgentRuntimeService",
                runtime_service_pb2_grpc.add_AgentRuntimeServiceServicer_to_server,
                AgentRuntimeServicer(runner, clients),
            )
        ],
        signer=signer,
        address=address or settings.addresses.agent_runtime,
        grace_s=settings.shutdown_grace_s,
    )
    server.on_stop.append(leases.stop)
    server.on_stop.append(clients.close)
    server.on_stop.append(llm.close)
    await server.start()
    leases.start()
    return server


async def main(settings: MeshSettings) -> None:
    server = await build(settings)
    await server.serve_until_signal()
