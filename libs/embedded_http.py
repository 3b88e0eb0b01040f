"""uvicorn in the caller's event loop, on a port it binds itself (0: a free one), ready when started.

Used where an HTTP app runs inside another program's loop: the scripted model server and the test
harnesses. The gateway process runs plain uvicorn on a socket from `bind` (gateway/server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn


class EmbeddedServer(uvicorn.Server):
    """No signal capture (the host program owns signals), and a `ready` event."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()
        self.port = 0
        self.task: asyncio.Task[None] | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.ready.set()

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self.task is None:
            return
        self.should_exit = True
        await asyncio.wait_for(self.task, timeout_s)
        self.task = None


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port (0: a free port). SO_REUSEADDR (as gRPC and uvicorn set it), so
    a restarted server binds over its predecessor's connections in TIME_WAIT; never SO_REUSEPORT: a
    port in use by another server is an error (OSError EADDRINUSE), not a port silently shared."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # asyncio sets TCP_NODELAY only then
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


async def serve(app: Any, host: str = "127.0.0.1", port: int = 0, **config: Any) -> EmbeddedServer:
    """Starts `app` in the running loop and returns once it accepts connections."""
    sock = bind(host, port)
    options: dict[str, Any] = {"log_config": None, "access_log": False, "timeout_graceful_shutdown": 2}
    options.update(config)
    server = EmbeddedServer(uvicorn.Config(app, **options))
    server.port = sock.getsockname()[1]
    server.task = asyncio.create_task(server.serve(sockets=[sock]))
    ready = asyncio.create_task(server.ready.wait())
    await asyncio.wait({server.task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        ready.cancel()
        raise RuntimeError(f"could not serve on {host}:{port}")
    return server
