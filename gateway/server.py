"""The gateway process: uvicorn serving the FastAPI app."""

from __future__ import annotations

import uvicorn

from gateway.app import create_app
from libs.config import MeshSettings
from libs.embedded_http import bind


def make_server(settings: MeshSettings) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        ws="websockets",
    )
    return uvicorn.Server(config)


async def main(settings: MeshSettings) -> None:
    sock = bind(settings.gateway_host, settings.gateway_port)
    await make_server(settings).serve(sockets=[sock])
