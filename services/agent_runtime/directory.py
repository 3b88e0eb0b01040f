"""The agents a run may meet, read from AgentService (served by the trace process) once per run:
an edit made anywhere is used by the next run on every replica."""

from __future__ import annotations

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import NotFound, rpc


class AgentDirectory:
    """Agents by slug for one run (as the run's user sees them), each fetched at most once."""

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self._seen: dict[str, ap.Agent] = {}

    def remember(self, agent: ap.Agent) -> None:
        self._seen[agent.slug] = agent

    async def get(self, slug: str) -> ap.Agent:
        """The agent; NotFound when there is none of that slug."""
        if not slug:
            raise NotFound("an agent slug is required")
        if slug not in self._seen:
            self._seen[slug] = (await rpc(self.clients.agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent
        return self._seen[slug]

    async def find(self, slug: str) -> ap.Agent | None:
        """The agent, or None when there is none of that slug."""
        try:
            return await self.get(slug)
        except NotFound:
            return None
