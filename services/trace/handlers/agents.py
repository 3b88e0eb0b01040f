"""AgentService's domain over the AgentStore: a user's writes (create, update by mask at a version,
delete, clone) checked against the rules of services/trace/agents.py and the mesh's tool catalog
(libs/tools.py), and the choices a user has when writing an agent."""

from __future__ import annotations

from collections.abc import Sequence

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.tools import AGENT_ROLE, BUILTIN, ROLES, ToolCatalog
from agentmesh.services.trace import agents as rules
from agentmesh.services.trace.domain import need_owner
from agentmesh.services.trace.store.base import AgentStore


class AgentHandler:
    def __init__(
        self, store: AgentStore, defaults: SubagentDefaults | None = None, tools: ToolCatalog = BUILTIN
    ) -> None:
        self.store = store
        self.defaults = defaults or SubagentDefaults()
        self.tools = tools

    async def get(self, owner: str, slug: str) -> ap.Agent:
        return await self.store.get_agent(owner, slug)

    async def list(self, owner: str) -> list[ap.Agent]:
        return await self.store.list_agents(owner)

    async def create(self, owner: str, agent: ap.Agent, paths: Sequence[str] = ()) -> ap.Agent:
        """A new agent of the owner's: the fields of `paths` from `agent` over the defaults (no paths:
        `agent` as it is, `limits` and `invoke` defaulted when unset)."""
        need_owner(owner)
        if paths:
            base = ap.Agent(limits=rules.DEFAULT_LIMITS, invoke=rules.DEFAULT_INVOKE)
            new = rules.merged(base, agent, paths, new=True)
        else:
            new = rules.normalized(agent)
        await self._check(owner, new)
        return await self.store.create_agent(owner, new)

    async def update(
        self, owner: str, agent: ap.Agent, paths: Sequence[str] = (), expected_version: int = 0
    ) -> ap.Agent:
        """The owner's own agent `agent.slug` with the fields of `paths` (none: every writable one) taken
        from `agent`, at `expected_version` (0: any)."""
        need_owner(owner)
        known = await self._known(owner)

        def change(current: ap.Agent) -> ap.Agent:
            new = rules.merged(current, agent, paths or rules.WRITABLE)
            rules.check_references(new, known, self.tools, self.defaults.blocked_tool_names)
            return new

        return await self.store.update_agent(owner, agent.slug, change, expected_version)

    async def delete(self, owner: str, slug: str, expected_version: int = 0) -> None:
        await self.store.delete_agent(owner, slug, expected_version)

    async def clone(self, owner: str, slug: str, new_slug: str = "", name: str = "") -> ap.Agent:
        """A new own agent with the settings of `slug` (the owner's own, else the built-in one); private,
        whatever the source is."""
        need_owner(owner)
        source = await self.store.get_agent(owner, slug)
        copy = rules.normalized(source)
        copy.slug = new_slug or rules.free_slug(slug, await self._known(owner))
        copy.name = name or f"{source.name[:193]} (copy)"
        copy.public = False
        copy.ClearField("remote")  # a copy runs here; only the catalog names remote agents
        copy = rules.normalized(copy)
        await self._check(owner, copy)
        return await self.store.create_agent(owner, copy)

    async def options(self, owner: str) -> ag.GetAgentOptionsResponse:
        """The tools (with the roles each runs in, from the tool catalog), the agents the owner may name
        as presets and callees, the ranges of the numbers and the defaults of a new agent."""
        need_owner(owner)
        blocked = self.defaults.blocked_tool_names
        by_role = {role: set(self.tools.choosable(role, blocked)) for role in ROLES}
        tools = [
            ag.ToolOption(
                name=spec.name,
                description=spec.description,
                roles=[AGENT_ROLE[r] for r in ROLES if spec.name in by_role[r]],
            )
            for spec in self.tools.specs.values()
            if any(spec.name in names for names in by_role.values())  # a tool no agent chooses: not offered
        ]
        choices = [ag.AgentChoice(slug=a.slug, name=a.name, owner=a.owner) for a in await self.list(owner)]
        defaults = rules.normalized(ap.Agent(slug="new", name="new"))
        defaults.ClearField("slug")
        defaults.ClearField("name")
        defaults.effective_subagent_config.CopyFrom(rules.effective_subagent_config(defaults, self.defaults))
        return ag.GetAgentOptionsResponse(
            tools=tools,
            preset_agents=choices,
            callees=[ag.AgentChoice(slug=rules.ANY_CALLEE, name="Any agent"), *choices],
            blocked_tool_names=blocked,
            ranges=[ag.NumberRange(field=r.field, min=r.min, max=r.max) for r in rules.RANGES],
            defaults=defaults,
        )

    async def _known(self, owner: str) -> set[str]:
        return {a.slug for a in await self.store.list_agents(owner)}

    async def _check(self, owner: str, agent: ap.Agent) -> None:
        rules.check_references(agent, await self._known(owner), self.tools, self.defaults.blocked_tool_names)
