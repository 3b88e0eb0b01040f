"""The A2A gRPC binding of the gateway process: `lf.a2a.v1.A2AService` (and v0.3's `a2a.v1.A2AService`)
on its own port (AGENTMESH_A2A__GRPC_LISTEN), served by the SDK's gRPC handlers over the same request
handler as JSON-RPC. A call names its agent by the card's tenant (the slug); `authorization: Bearer KEY`
metadata is checked like the HTTP header (UNAUTHENTICATED otherwise)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
from a2a.compat.v0_3 import a2a_v0_3_pb2_grpc
from a2a.compat.v0_3.grpc_handler import CompatGrpcHandler
from a2a.server.request_handlers import GrpcHandler
from a2a.types import a2a_pb2_grpc

from agentmesh.gateway.deps import authenticate
from agentmesh.libs import identity, telemetry
from agentmesh.libs.errors import MeshError, Unauthenticated
from agentmesh.libs.rpc import refused, server_options, with_principal

log = logging.getLogger(__name__)


class BearerInterceptor(grpc.aio.ServerInterceptor):
    """Checks `authorization: Bearer KEY` with the gateway's AuthService lookup (and its cache) and runs
    the call as that user."""

    def __init__(self, app_state: Any) -> None:
        self.app_state = app_state

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        header = metadata.get("authorization")
        try:
            user = await authenticate(self.app_state, header if isinstance(header, str) else None)
        except MeshError as err:
            refusal = err if isinstance(err, Unauthenticated) else Unauthenticated(err.message)
            return refused(handler, refusal)
        return with_principal(handler, identity.Principal(user))


class A2AGrpcServer:
    def __init__(self, app_state: Any, request_handler: Any, address: str, max_queued_s: float) -> None:
        self.address = address
        self.port = 0
        self.server = grpc.aio.server(
            # the mesh's message sizes and keepalive; an outside caller that sets no deadline still
            # gets its call taken within max_queued_s, not cancelled after gRPC's default 30 s
            options=server_options(max_queued_s),
            interceptors=[*telemetry.server_interceptors(), BearerInterceptor(app_state)],
        )
        a2a_pb2_grpc.add_A2AServiceServicer_to_server(GrpcHandler(request_handler), self.server)
        a2a_v0_3_pb2_grpc.add_A2AServiceServicer_to_server(CompatGrpcHandler(request_handler), self.server)

    @property
    def target(self) -> str:
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> bool:
        """Binds and serves; False (logged) when the address cannot be bound: the gateway goes on
        without the gRPC binding and its cards do not name it."""
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:
            self.port = 0
        if not self.port:
            log.warning("cannot bind the A2A gRPC address", extra={"address": self.address})
            return False
        await self.server.start()
        log.info("A2A gRPC serving", extra={"address": self.target})
        return True

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)
