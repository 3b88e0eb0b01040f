"""What a request to the A2A server carries besides its message, read alike for both transports: the
agent it addresses (the JSON-RPC path, or the gRPC tenant) and its headers (HTTP headers, or gRPC
metadata)."""

from __future__ import annotations

from typing import Any

from a2a.server.context import ServerCallContext

AGENT_KEY = "agentmesh.agent"  # ServerCallContext.state: the slug in the request's path
INBOUND_KEY = "agentmesh.inbound"  # ServerCallContext.state: the Inbound a SendMessage created


def addressed_agent(context: ServerCallContext | None) -> str:
    """The slug a request addresses: its path (JSON-RPC) or its tenant (gRPC); "" when neither."""
    if context is None:
        return ""
    return str(context.state.get(AGENT_KEY) or context.tenant or "")


def header(context: ServerCallContext | None, name: str) -> str:
    """A request header (JSON-RPC) or metadata value (gRPC), "" when absent."""
    if context is None:
        return ""
    name = name.lower()
    headers: Any = context.state.get("headers")
    if isinstance(headers, dict):
        return str(headers.get(name, ""))
    grpc_context = context.state.get("grpc_context")
    if grpc_context is not None:
        for key, value in grpc_context.invocation_metadata() or ():
            if key.lower() == name:
                return value if isinstance(value, str) else value.decode("utf-8", "replace")
    return ""
