"""The gateway process: uvicorn serving the FastAPI app."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from libs.config import MeshSettings


def make_server(settings: MeshSettings, port: int | None = None) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port if port is None else port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        ws="websockets-sansio",
    )
    return uvicorn.Server(config)


async def main(settings: MeshSettings) -> None:
    await make_server(settings).serve()
