"""The gateway process: uvicorn serving the FastAPI app, draining live streams on SIGTERM."""

from __future__ import annotations

import asyncio
from types import FrameType

import uvicorn

from gateway.app import create_app
from libs.config import MeshSettings
from libs.embedded_http import bind


class GatewayServer(uvicorn.Server):
    """On SIGTERM/SIGINT the drain begins at once (every live SSE response and WebSocket gets its
    `shutdown` farewell); uvicorn then stops accepting and waits for the connections to close, within
    the grace."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets=sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.app
        if self.loop is not None and hasattr(app, "state"):
            self.loop.call_soon_threadsafe(app.state.drain.begin)
        super().handle_exit(sig, frame)


def make_server(settings: MeshSettings) -> GatewayServer:
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        ws="websockets",
    )
    return GatewayServer(config)


async def main(settings: MeshSettings) -> None:
    sock = bind(settings.gateway_host, settings.gateway_port)
    await make_server(settings).serve(sockets=[sock])
