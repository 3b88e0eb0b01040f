"""The orchestrator process: one chat turn at a time per session, the entry of HTTP and WebSocket."""

from __future__ import annotations

from agentmesh.v1 import orchestrator_service_pb2_grpc as orc_grpc
from libs.catalog import Catalog, load_catalog
from libs.clients import Clients
from libs.config import MeshSettings
from libs.rpc import Registration, ServiceServer
from services.orchestrator.chat import ChatOrchestrator
from services.orchestrator.servicer import OrchestratorServicer

SERVICE_NAME = "agentmesh.v1.OrchestratorService"


async def build(
    settings: MeshSettings, address: str | None = None, catalog: Catalog | None = None
) -> ServiceServer:
    clients = Clients.connect(settings)
    chat = ChatOrchestrator(settings, clients, catalog or load_catalog(settings.catalog))
    server = ServiceServer(
        [
            Registration(
                orc_grpc.add_OrchestratorServiceServicer_to_server, OrchestratorServicer(chat), SERVICE_NAME
            )
        ],
        address=address or settings.addresses.orchestrator,
        grace_s=settings.shutdown_grace_s,
    )
    server.on_stop.append(lambda: chat.drain(server.stop_grace_s))
    server.on_stop.append(clients.close)
    return await server.start()


async def main(settings: MeshSettings) -> None:
    server = await build(settings)
    await server.serve_until_signal()
