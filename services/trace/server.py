"""The trace process: engine, migrations, the built-in agents, and its services: TraceService,
MessageService, TaskService and SubagentService (the trace domain), AgentService, AuthService and
LeaseService."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from agentmesh.agents.v1 import agent_service_pb2, agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2, auth_service_pb2_grpc
from agentmesh.leases.v1 import lease_service_pb2, lease_service_pb2_grpc
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.files import private_dir
from agentmesh.libs.identity import Signer, signer_for
from agentmesh.libs.metrics import PeerMetrics, TraceStoreMetrics
from agentmesh.libs.peer_http import PeerClients
from agentmesh.libs.peers import PeerRegistry
from agentmesh.libs.rpc import Registration, ServiceServer, server_settings
from agentmesh.services.trace.agents import load_catalog
from agentmesh.services.trace.handlers.agents import AgentHandler
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.runs import RunHandler
from agentmesh.services.trace.handlers.subagents import SubagentHandler
from agentmesh.services.trace.handlers.tasks import TaskHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.servicers.agents import AgentServicer, AuthServicer, LeaseServicer
from agentmesh.services.trace.servicers.messages import MessageServicer
from agentmesh.services.trace.servicers.subagents import SubagentServicer
from agentmesh.services.trace.servicers.tasks import TaskServicer
from agentmesh.services.trace.servicers.traces import TraceServicer
from agentmesh.services.trace.store.hybrid import HybridTraceStore
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.db import create_engine, migrate, time_queries
from agentmesh.trace.v1 import (
    message_service_pb2,
    message_service_pb2_grpc,
    subagent_service_pb2,
    subagent_service_pb2_grpc,
    task_service_pb2,
    task_service_pb2_grpc,
    trace_service_pb2,
    trace_service_pb2_grpc,
)


async def build(
    settings: MeshSettings, address: str | None = None, signer: Signer | None = None
) -> ServiceServer:
    """Migrates the database (`upgrade head`), imports the catalog's built-in agents and starts the
    gRPC server. The returned server is started; its `stop()` also disposes the engine."""
    # a malformed file or an unset credential variable stops the start (docs/federation.md)
    peer_registry = PeerRegistry.load(settings.peers).require_credentials()
    url = settings.sqlalchemy_url
    # trace_store.internal (docs/requirements.md#shared-database-mode)
    if peer_registry.store.internal_url and not settings.database_url:
        url = settings.model_copy(update={"database_url": peer_registry.store.internal_url}).sqlalchemy_url
    if url.startswith("sqlite"):
        private_dir(settings.data_dir)
    engine = create_engine(url)
    registry = CollectorRegistry()
    time_queries(engine, TraceStoreMetrics(registry))
    try:
        await migrate(engine)
        stores = SqlStores.open(engine, settings.subagent, settings.lease_s)
        await stores.agents.import_builtins(load_catalog(settings.catalog))
        peers = PeerClients(settings.federation, metrics=PeerMetrics(registry))
        # Traces and messages: this mesh's, or a peer's through a cached copy (one store for both).
        federated = HybridTraceStore(
            stores.traces,
            stores.messages,
            stores.copies,
            peer_registry,
            peers,
            page_size=settings.federation.page_size,
            cached_read_wait_s=settings.federation.cached_read_wait_s,
            deadline_margin_s=settings.federation.deadline_margin_s,
        )
        signer = signer or signer_for(settings)
        messages = MessageHandler(federated, stores.subagents)
        server = ServiceServer(
            [
                Registration.of(
                    trace_service_pb2,
                    "TraceService",
                    trace_service_pb2_grpc.add_TraceServiceServicer_to_server,
                    TraceServicer(TraceHandler(federated), RunHandler(stores.runs)),
                ),
                Registration.of(
                    message_service_pb2,
                    "MessageService",
                    message_service_pb2_grpc.add_MessageServiceServicer_to_server,
                    MessageServicer(messages, signer),
                ),
                Registration.of(
                    task_service_pb2,
                    "TaskService",
                    task_service_pb2_grpc.add_TaskServiceServicer_to_server,
                    TaskServicer(TaskHandler(stores.tasks, federated)),
                ),
                Registration.of(
                    subagent_service_pb2,
                    "SubagentService",
                    subagent_service_pb2_grpc.add_SubagentServiceServicer_to_server,
                    SubagentServicer(SubagentHandler(stores.subagents)),
                ),
                Registration.of(
                    agent_service_pb2,
                    "AgentService",
                    agent_service_pb2_grpc.add_AgentServiceServicer_to_server,
                    AgentServicer(AgentHandler(stores.agents, settings.subagent)),
                ),
                Registration.of(
                    auth_service_pb2,
                    "AuthService",
                    auth_service_pb2_grpc.add_AuthServiceServicer_to_server,
                    AuthServicer(stores.keys),
                ),
                Registration.of(
                    lease_service_pb2,
                    "LeaseService",
                    lease_service_pb2_grpc.add_LeaseServiceServicer_to_server,
                    LeaseServicer(stores.leases),
                ),
            ],
            signer=signer,
            on_stop=[federated.close, engine.dispose, peers.close],
            registry=registry,
            **{**server_settings(settings, "trace"), **({"address": address} if address else {})},
        )
        return await server.start()
    except BaseException:
        await engine.dispose()
        raise


async def main(settings: MeshSettings) -> None:
    """Runs the trace service until SIGTERM/SIGINT."""
    server = await build(settings)
    await server.serve_until_signal()
