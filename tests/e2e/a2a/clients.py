"""The official a2a-sdk client, as another organisation's program would use it against our gateway."""

from __future__ import annotations

import uuid
from typing import Any

import grpc
import httpx
from a2a.client import ClientCallContext, ClientConfig, ClientFactory
from a2a.client.auth import AuthInterceptor
from a2a.client.auth.credentials import CredentialService
from a2a.client.client import Client
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol


class Key(CredentialService):
    """Our API key for the card's Bearer scheme."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def get_credentials(
        self, security_scheme_name: str, context: ClientCallContext | None
    ) -> str | None:
        return self.key


async def sdk_client(base: str, key: str, binding: str = TransportProtocol.JSONRPC, **config: Any) -> Client:
    """A client of the agent whose card is at `base`/.well-known/agent-card.json, on `binding`; the key
    goes with every call through the SDK's AuthInterceptor (the card says HTTP Bearer)."""
    http = httpx.AsyncClient(timeout=30)
    factory = ClientFactory(
        ClientConfig(
            httpx_client=http,
            supported_protocol_bindings=[binding],
            use_client_preference=True,
            grpc_channel_factory=grpc.aio.insecure_channel,
            **config,
        )
    )
    return await factory.create_from_url(base, interceptors=[AuthInterceptor(Key(key))])


def text_message(text: str, context_id: str = "", **metadata: Any) -> a2a.SendMessageRequest:
    message = a2a.Message(
        message_id=uuid.uuid4().hex, role=a2a.ROLE_USER, parts=[a2a.Part(text=text)], context_id=context_id
    )
    if metadata:
        message.metadata.update(metadata)
    return a2a.SendMessageRequest(message=message)


def text_of(responses: list[a2a.StreamResponse]) -> str:
    """The reply text streamed as artifact chunks."""
    return "".join(
        p.text for r in responses if r.HasField("artifact_update") for p in r.artifact_update.artifact.parts
    )


def state_of(response: a2a.StreamResponse) -> int:
    if response.HasField("task"):
        return response.task.status.state  # type: ignore[no-any-return]
    if response.HasField("status_update"):
        return response.status_update.status.state  # type: ignore[no-any-return]
    return 0
