"""An agent's A2A card: who it is, where it answers (JSON-RPC at /a2a/{slug}, in v1.0 and v0.3, and
gRPC at the gateway's A2A port with the slug as tenant), streaming, and HTTP Bearer with our API keys."""

from __future__ import annotations

from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import PROTOCOL_VERSION_0_3, PROTOCOL_VERSION_1_0, TransportProtocol

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.libs.a2a import BEARER_SCHEME
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, NotFound, rpc


def agent_card(agent: ap.Agent, base_url: str, grpc_url: str, push: bool = False) -> a2a.AgentCard:
    """`push`: the gateway calls some URLs (AGENTMESH_A2A__PUSH_ALLOWED_URLS), so the card says so."""
    url = f"{base_url}/a2a/{agent.slug}"
    interfaces = [
        a2a.AgentInterface(
            url=url, protocol_binding=TransportProtocol.JSONRPC, protocol_version=PROTOCOL_VERSION_1_0
        )
    ]
    if grpc_url:
        interfaces.append(
            a2a.AgentInterface(
                url=grpc_url,
                protocol_binding=TransportProtocol.GRPC,
                protocol_version=PROTOCOL_VERSION_1_0,
                tenant=agent.slug,
            )
        )
    interfaces.append(
        a2a.AgentInterface(
            url=url, protocol_binding=TransportProtocol.JSONRPC, protocol_version=PROTOCOL_VERSION_0_3
        )
    )
    description = agent.description or agent.name
    return a2a.AgentCard(
        name=agent.name,
        description=description,
        version=str(agent.version or 1),
        supported_interfaces=interfaces,
        provider=a2a.AgentProvider(organization="agentmesh", url=base_url),
        capabilities=a2a.AgentCapabilities(streaming=True, push_notifications=push),
        security_schemes={
            BEARER_SCHEME: a2a.SecurityScheme(
                http_auth_security_scheme=a2a.HTTPAuthSecurityScheme(
                    scheme="Bearer", description="an agentmesh API key (am_...)"
                )
            )
        },
        security_requirements=[a2a.SecurityRequirement(schemes={BEARER_SCHEME: a2a.StringList()})],
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[a2a.AgentSkill(id=agent.slug, name=agent.name, description=description, tags=["agentmesh"])],
    )


async def public_agent(clients: Clients, slug: str) -> ap.Agent | None:
    """The public agent `slug` as the calling user sees it (theirs or built-in), or None."""
    if not slug:
        return None
    try:
        agent = (await rpc(clients.agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent
    except (NotFound, InvalidArgument):
        return None
    return agent if agent.public and not agent.HasField("remote") else None
