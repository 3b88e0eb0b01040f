"""The gateway: thin HTTP + SSE and WebSocket translation over the mesh's gRPC services."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from gateway.drain import Drain
from gateway.limits import BodyLimitMiddleware
from gateway.metrics import Metrics, MetricsMiddleware, metrics_endpoint
from gateway.routes import agents, chat, sessions, streams, ui
from libs import telemetry
from libs.clients import Clients
from libs.config import MeshSettings
from libs.errors import MeshError, from_rpc_error

log = logging.getLogger(__name__)


def create_app(settings: MeshSettings, clients: Clients | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = clients is None
        app.state.clients = clients or Clients(settings)
        try:
            yield
        finally:
            if own:
                await app.state.clients.close()

    app = FastAPI(title="agentmesh gateway", lifespan=lifespan)
    app.state.settings = settings
    app.state.drain = Drain()
    app.state.auth_cache = {}
    app.state.metrics = Metrics()
    app.add_middleware(BodyLimitMiddleware)
    app.add_middleware(MetricsMiddleware, metrics=app.state.metrics)
    if clients is not None:
        app.state.clients = clients

    @app.exception_handler(MeshError)
    async def mesh_error(_: Request, err: MeshError) -> JSONResponse:
        return JSONResponse(err.json_body(), status_code=err.http_status)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_error(_: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        err = from_rpc_error(exc)
        return JSONResponse(err.json_body(), status_code=err.http_status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
        body = {
            "error": {
                "code": 422,
                "reason": "INVALID_ARGUMENT",
                "message": "invalid request",
                "details": details,
            }
        }
        return JSONResponse(body, status_code=422)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    app.add_route("/metrics", metrics_endpoint, methods=["GET"], include_in_schema=False)
    app.include_router(chat.router)
    app.include_router(sessions.router)
    app.include_router(streams.router)  # before agents: /api/agents/a2a/stream
    app.include_router(agents.router)
    app.include_router(ui.router)
    telemetry.instrument_app(app)  # with tracing on: the browser's traceparent starts the request's span
    return app
