"""The A2A server's parts for one gateway process, started and stopped with the app: the request
handler, the JSON-RPC dispatcher, the gRPC binding."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from a2a.server.routes.jsonrpc_dispatcher import JsonRpcDispatcher

from agentmesh.gateway.a2a.grpc_server import A2AGrpcServer
from agentmesh.gateway.a2a.handler import MeshRequestHandler
from agentmesh.gateway.a2a.routes import dispatcher
from agentmesh.libs.config import MeshSettings


@dataclass
class A2AServer:
    handler: MeshRequestHandler
    dispatcher: JsonRpcDispatcher
    grpc: A2AGrpcServer | None = None
    grpc_url: str = ""  # what cards name as the gRPC interface ("" when there is none)

    async def stop(self, grace_s: float) -> None:
        if self.grpc is not None:
            await self.grpc.stop(grace_s)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.handler.aclose(), grace_s + 5)


async def start(app_state: Any, settings: MeshSettings) -> A2AServer:
    handler = MeshRequestHandler(app_state.clients, settings, app_state.drain, settings.a2a.default_agent)
    server = A2AServer(handler, dispatcher(handler))
    if settings.a2a.grpc_listen:
        listen, max_queued_s = settings.a2a.grpc_listen, settings.stream_rpc_timeout_s
        grpc_server = A2AGrpcServer(app_state, handler, listen, max_queued_s)
        if await grpc_server.start():
            server.grpc = grpc_server
            server.grpc_url = settings.a2a.grpc_url or grpc_server.target
    return server
