"""The trace service process: engine, migrations, agent sync, gRPC server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentmesh.v1 import trace_service_pb2_grpc
from libs.catalog import load_catalog
from libs.config import MeshSettings
from libs.rpc import Registration, ServiceServer
from services.trace.db import create_engine, migrate
from services.trace.servicer import TraceServicer
from services.trace.store import TraceStore

SERVICE_NAME = "agentmesh.v1.TraceService"


async def build(settings: MeshSettings, address: str | None = None) -> ServiceServer:
    """Migrates the database (`upgrade head`), syncs the catalog agents and starts the gRPC server.
    The returned server is started; its `stop()` also disposes the engine."""
    url = settings.sqlalchemy_url
    if url.startswith("sqlite"):
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url)
    try:
        await migrate(engine)
        store = TraceStore(engine)
        await store.sync_agents(load_catalog(settings.catalog))
    except BaseException:
        await engine.dispose()
        raise
    server = ServiceServer(
        [
            Registration(
                trace_service_pb2_grpc.add_TraceServiceServicer_to_server, TraceServicer(store), SERVICE_NAME
            )
        ],
        address=address or settings.addresses.trace,
        grace_s=settings.shutdown_grace_s,
        on_stop=[engine.dispose],
    )
    try:
        return await server.start()
    except BaseException:
        await engine.dispose()
        raise


async def main(settings: MeshSettings) -> None:
    """Runs the trace service until SIGTERM/SIGINT."""
    server = await build(settings)
    await server.serve_until_signal()


async def start_test_server(
    database_url: str, data_dir: Path, catalog: Path | None = None, **overrides: object
) -> ServiceServer:
    """A trace service on 127.0.0.1 port 0 for tests: `database_url` is a PostgreSQL URL (e.g. the
    `pg_url` fixture) or "" for a SQLite file in `data_dir`. Stop it with `await server.stop(0)`."""
    fields: dict[str, Any] = {"database_url": database_url, "data_dir": data_dir, **overrides}
    if catalog is not None:
        fields["catalog"] = catalog
    return await build(MeshSettings(**fields), address="127.0.0.1:0")
