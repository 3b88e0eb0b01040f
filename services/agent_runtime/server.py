"""The agent-runtime process: the model loop, the tool registry, delegation."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.identity import Signer, signer_for
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import RuntimeMetrics
from agentmesh.libs.rpc import Registration, ServiceServer, server_settings
from agentmesh.runtime.v1 import runtime_service_pb2, runtime_service_pb2_grpc
from agentmesh.services.agent_runtime import builtin_tools
from agentmesh.services.agent_runtime.llm import LLM
from agentmesh.services.agent_runtime.runner import AgentRunner
from agentmesh.services.agent_runtime.servicer import AgentRuntimeServicer
from agentmesh.services.agent_runtime.tools import ToolRegistry


def build_registry() -> ToolRegistry:
    registry = ToolRegistry()
    builtin_tools.register_all(registry)
    return registry


async def build(
    settings: MeshSettings, address: str | None = None, signer: Signer | None = None
) -> ServiceServer:
    signer = signer or signer_for(settings)
    clients = Clients(settings, signer)
    registry = CollectorRegistry()
    metrics = RuntimeMetrics(registry)
    llm = LLM(settings.llm, metrics=metrics)
    leases = LeaseKeeper(clients, settings.lease_s)
    runner = AgentRunner(settings, clients, llm, build_registry(), leases, metrics)
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
        registry=registry,
        **{**server_settings(settings, "agent_runtime"), **({"address": address} if address else {})},
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
