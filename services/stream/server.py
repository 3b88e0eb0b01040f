"""The stream service process: a StreamServicer over the configured backend."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from agentmesh.libs.config import MeshSettings
from agentmesh.libs.identity import Signer, signer_for
from agentmesh.libs.metrics import StreamMetrics
from agentmesh.libs.rpc import Registration, ServiceServer, server_settings
from agentmesh.services.stream.backend import StreamBackend
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.services.stream.redis_backend import RedisBackend
from agentmesh.services.stream.servicer import StreamServicer
from agentmesh.stream.v1 import stream_service_pb2, stream_service_pb2_grpc


def make_backend(settings: MeshSettings) -> StreamBackend:
    """`settings.stream.backend`: "memory" (embedded default) or "redis" (at settings.redis_url)."""
    kind = settings.stream.backend
    if kind == "memory":
        return MemoryBackend(settings.stream)
    if kind == "redis":
        return RedisBackend(settings.redis_url, settings.stream, prefix=settings.stream.redis_prefix)
    raise ValueError(f"unknown stream backend {kind!r}: expected memory or redis")


@dataclass
class StreamServer(ServiceServer):
    """A ServiceServer whose stop ends live subscriptions first (UNAVAILABLE: resume elsewhere), so the
    drain of in-flight RPCs is not held up by subscribers that would otherwise follow forever."""

    backend: StreamBackend | None = None

    async def stop(self, grace_s: float | None = None) -> None:
        if self.backend is not None and not self._stopped.is_set():
            await self.health.enter_graceful_shutdown()
            self.backend.shutdown()
        await super().stop(grace_s)


async def build(
    settings: MeshSettings,
    address: str | None = None,
    backend: StreamBackend | None = None,
    signer: Signer | None = None,
) -> ServiceServer:
    """An unstarted server. A backend passed in stays the caller's to close; one built here from the
    settings is closed when the server stops."""
    owned = backend is None
    registry = CollectorRegistry()
    backend = backend or make_backend(settings)
    backend.metrics = StreamMetrics(registry)  # this server's series, whoever made the backend
    await backend.start()
    signer = signer or signer_for(settings)
    servicer = StreamServicer(backend, signer)
    return StreamServer(
        [
            Registration.of(
                stream_service_pb2,
                "StreamService",
                stream_service_pb2_grpc.add_StreamServiceServicer_to_server,
                servicer,
            )
        ],
        signer=signer,
        on_stop=[backend.aclose] if owned else [],
        backend=backend,
        registry=registry,
        metrics_refresh=[backend.refresh_metrics],
        **{**server_settings(settings, "stream"), **({"address": address} if address else {})},
    )


async def main(settings: MeshSettings) -> None:
    """Builds, starts and serves until SIGTERM/SIGINT, then drains and closes the backend."""
    server = await build(settings)
    try:
        await server.start()
        await server.serve_until_signal()
    finally:
        await server.stop()
