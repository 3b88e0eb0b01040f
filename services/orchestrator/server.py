"""The orchestrator process: the owner of every turn (docs/design/turns.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.identity import Signer, signer_for
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import OrchestratorMetrics
from agentmesh.libs.rpc import Registration, ServiceServer, server_settings
from agentmesh.orchestrator.v1 import orchestrator_service_pb2, orchestrator_service_pb2_grpc
from agentmesh.services.orchestrator.orchestrator import Orchestrator
from agentmesh.services.orchestrator.reaper import Reaper
from agentmesh.services.orchestrator.servicer import OrchestratorServicer


async def build(
    settings: MeshSettings, address: str | None = None, signer: Signer | None = None
) -> ServiceServer:
    signer = signer or signer_for(settings)
    clients = Clients(settings, signer)
    registry = CollectorRegistry()
    metrics = OrchestratorMetrics(registry)
    leases = LeaseKeeper(clients, settings.lease_s)
    reaper = Reaper(clients, settings.lease_s, metrics)
    orchestrator = Orchestrator(settings, clients, leases, metrics)
    server = ServiceServer(
        [
            Registration.of(
                orchestrator_service_pb2,
                "OrchestratorService",
                orchestrator_service_pb2_grpc.add_OrchestratorServiceServicer_to_server,
                OrchestratorServicer(orchestrator),
            )
        ],
        signer=signer,
        registry=registry,
        **{**server_settings(settings, "orchestrator"), **({"address": address} if address else {})},
    )
    server.on_drain.append(orchestrator.drain)
    server.on_stop.append(reaper.stop)
    server.on_stop.append(leases.stop)
    server.on_stop.append(clients.close)
    await server.start()
    leases.start()
    reaper.start()  # at once: a restarted orchestrator settles the orphans of its previous life
    return server


async def main(settings: MeshSettings) -> None:
    server = await build(settings)
    await server.serve_until_signal()
