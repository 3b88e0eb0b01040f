"""The gateway: thin HTTP + SSE and WebSocket translation over the mesh's gRPC services."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from agentmesh.gateway import errors, openapi
from agentmesh.gateway.a2a import mount as a2a_server
from agentmesh.gateway.a2a import push_receiver as a2a_push_receiver
from agentmesh.gateway.a2a import push_routes as a2a_push_routes
from agentmesh.gateway.a2a import routes as a2a_routes
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.jsonbody import JsonBoundMiddleware
from agentmesh.gateway.limits import BodyLimitMiddleware, HeadLimitMiddleware, TraceGZipMiddleware
from agentmesh.gateway.metrics import Metrics, MetricsMiddleware, metrics_endpoint
from agentmesh.gateway.routes import agents, chat, runs, sessions, streams, traces, ui
from agentmesh.libs import telemetry
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.metrics import MetricsServer

log = logging.getLogger(__name__)


def create_app(settings: MeshSettings, clients: Clients | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = clients is None
        app.state.clients = clients or Clients(settings)
        if settings.gateway_metrics_listen:  # GET /metrics there, not on the public port
            app.state.metrics_server = MetricsServer(
                settings.gateway_metrics_listen, app.state.metrics.registry
            )
            await app.state.metrics_server.start()
        app.state.a2a = await a2a_server.start(app.state, settings)
        app.state.push_receiver = a2a_push_receiver.PushReceiver(app.state.clients, settings)
        try:
            yield
        finally:
            await app.state.push_receiver.aclose()
            await app.state.a2a.stop(settings.shutdown_grace_s)
            if app.state.metrics_server is not None:
                await app.state.metrics_server.stop()
            if own:
                await app.state.clients.close()

    # No redirect from "/x/" to "/x": it kept the method, so DELETE /api/sessions/ (an empty id) became
    # DELETE /api/sessions, every session; an unknown path is a 404.
    app = FastAPI(title="agentmesh gateway", lifespan=lifespan, redirect_slashes=False)
    app.state.settings = settings
    app.state.drain = Drain()
    app.state.auth_cache = {}
    app.state.auth_pending = {}  # AuthService look-ups under way, by key
    app.state.metrics = Metrics()
    app.state.metrics_server = None
    app.state.undocumented_paths = a2a_routes.PATHS + a2a_push_routes.PATHS + a2a_push_receiver.PATHS
    app.add_middleware(JsonBoundMiddleware)  # the JSON bound on API bodies (libs/jsonbound.py)
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(HeadLimitMiddleware)  # a head over the limits reaches no route (still counted)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    app.add_middleware(TraceGZipMiddleware)  # the trace API, when the client accepts gzip (never SSE)
    if clients is not None:
        app.state.clients = clients

    errors.install(app)
    openapi.install(app)

    @app.get("/healthz", responses={**openapi.ok(openapi.obj(status={"const": "ok"})), **errors.responses()})
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    if not settings.gateway_metrics_listen:
        app.add_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.include_router(chat.router)
    app.include_router(sessions.router)
    app.include_router(runs.router)
    app.include_router(traces.router)
    app.include_router(streams.router)  # before agents: /api/agents/a2a/stream
    app.include_router(agents.router)
    app.include_router(a2a_routes.router)
    app.include_router(a2a_push_routes.router)
    app.include_router(a2a_push_receiver.router)
    app.include_router(ui.router)
    telemetry.instrument_app(app)  # with tracing on: the browser's traceparent starts the request's span
    return app
