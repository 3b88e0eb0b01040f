"""The stream service process: a StreamServicer over the configured backend."""

from __future__ import annotations

from agentmesh.v1 import stream_service_pb2_grpc
from libs.config import MeshSettings
from libs.rpc import Registration, ServiceServer
from services.stream.backend import StreamBackend
from services.stream.memory import MemoryBackend
from services.stream.redis_backend import RedisBackend
from services.stream.servicer import StreamServicer

SERVICE_NAME = "agentmesh.v1.StreamService"


def make_backend(settings: MeshSettings) -> StreamBackend:
    """`settings.stream.backend`: "memory" (embedded default) or "redis" (at settings.redis_url)."""
    kind = settings.stream.backend
    if kind == "memory":
        return MemoryBackend(settings.stream)
    if kind == "redis":
        return RedisBackend(settings.redis_url, settings.stream)
    raise ValueError(f"unknown stream backend {kind!r}: expected memory or redis")


async def build(
    settings: MeshSettings, address: str | None = None, backend: StreamBackend | None = None
) -> ServiceServer:
    """An unstarted server; stopping it first ends every subscription (UNAVAILABLE) so the drain is quick.

    The caller owns `backend` (and closes it after stopping the server).
    """
    backend = backend or make_backend(settings)
    await backend.start()
    return ServiceServer(
        [
            Registration(
                stream_service_pb2_grpc.add_StreamServiceServicer_to_server,
                StreamServicer(backend),
                SERVICE_NAME,
            )
        ],
        address=address or settings.addresses.stream,
        grace_s=settings.shutdown_grace_s,
        on_stop=[backend.shutdown],
    )


async def main(settings: MeshSettings) -> None:
    """Builds, starts and serves until SIGTERM/SIGINT, then drains and closes the backend."""
    backend = make_backend(settings)
    server = await build(settings, backend=backend)
    try:
        await server.start()
        await server.serve_until_signal()
    finally:
        await server.stop()
        await backend.aclose()
