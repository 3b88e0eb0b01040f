"""The agent-runtime process: the model loop, the tool registry, delegation."""

from __future__ import annotations

from agentmesh.v1 import agent_runtime_service_pb2_grpc as rt_grpc
from libs.catalog import Catalog, load_catalog
from libs.clients import Clients
from libs.config import MeshSettings
from libs.rpc import Registration, ServiceServer
from services.agent_runtime import builtin_tools
from services.agent_runtime.llm import LLM
from services.agent_runtime.runner import AgentRunner
from services.agent_runtime.servicer import AgentRuntimeServicer
from services.agent_runtime.tools import ToolRegistry

SERVICE_NAME = "agentmesh.v1.AgentRuntimeService"


def build_registry(settings: MeshSettings) -> ToolRegistry:
    registry = ToolRegistry(settings)
    builtin_tools.register_all(registry)
    return registry


async def build(
    settings: MeshSettings, address: str | None = None, catalog: Catalog | None = None
) -> ServiceServer:
    clients = Clients.connect(settings)
    llm = LLM(settings.llm)
    runner = AgentRunner(
        settings, clients, catalog or load_catalog(settings.catalog), llm, build_registry(settings)
    )
    server = ServiceServer(
        [
            Registration(
                rt_grpc.add_AgentRuntimeServiceServicer_to_server,
                AgentRuntimeServicer(runner, clients),
                SERVICE_NAME,
            )
        ],
        address=address or settings.addresses.agent_runtime,
        grace_s=settings.shutdown_grace_s,
    )
    server.on_stop.append(clients.close)
    server.on_stop.append(llm.close)
    return await server.start()


async def main(settings: MeshSettings) -> None:
    server = await build(settings)
    await server.serve_until_signal()
