"""The gateway process: uvicorn serving the FastAPI app, draining live streams on SIGTERM."""

from __future__ import annotations

import asyncio
from types import FrameType
from typing import Any

import uvicorn

from agentmesh.gateway.app import create_app
from agentmesh.gateway.limits import HEAD_TIMEOUT_S, MAX_BODY_BYTES, MAX_HEAD_BYTES, HeadTimeoutProtocol
from agentmesh.libs.aio import settle_heap
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.embedded_http import bind


def http_limits(head_timeout_s: float = HEAD_TIMEOUT_S) -> dict[str, Any]:
    """uvicorn options every gateway runs with, this process and the test harness alike (tests/mesh.py):
    the protocol implementations and their limits (gateway/limits.py has the rest).

    h11 (with a deadline on request heads), never httptools, whose parser takes none of these limits;
    the `websockets` implementation, deprecated by uvicorn but the one that answers an upgrade with an
    over-long request line with 400 and closes: `websockets-sansio` (uvicorn 0.54) leaves that socket
    open with no answer (tests/integration/gateway/test_hostile.py).
    """
    protocol: type[HeadTimeoutProtocol] = HeadTimeoutProtocol
    if head_timeout_s != HEAD_TIMEOUT_S:
        protocol = type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})
    return {
        "http": protocol,
        "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
        "ws": "websockets",
        "ws_max_size": MAX_BODY_BYTES,
    }


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

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[type-arg]
        await super().startup(sockets=sockets)
        settle_heap()  # the app is built and listening

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        app = self.config.app
        if self.loop is not None and hasattr(app, "state"):
            self.loop.call_soon_threadsafe(app.state.drain.begin)
        super().handle_exit(sig, frame)


def make_server(settings: MeshSettings) -> GatewayServer:
    config = uvicorn.Config(
        create_app(settings),
        log_config=None,  # every line through the process's one formatter (libs/log.py)
        access_log=settings.gateway_access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s),
        **http_limits(),
    )
    return GatewayServer(config)


async def main(settings: MeshSettings) -> None:
    sock = bind(settings.gateway_host, settings.gateway_port)
    await make_server(settings).serve(sockets=[sock])
