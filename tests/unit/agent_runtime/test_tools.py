"""The runtime's tool registry in two layers
(docs/requirements.md#tool-layers), over the test catalog's agents as
the trace service serves them (services.trace.agents), and the subagent planning rules."""

from __future__ import annotations

from typing import Any

import pytest

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.agent_runtime import subagents
from agentmesh.services.agent_runtime.server import build_registry
from agentmesh.services.agent_runtime.tools import (
    A2A_CALLEE,
    ROLES,
    SUBAGENT,
    SUPERVISOR,
    RunState,
    ToolContext,
)
from agentmesh.services.trace.agents import effective_subagent_config, load_catalog
from tests.mesh import TEST_CATALOG

GLOBAL = SubagentDefaults(max_concurrent=3, timeout_ms=20000)


def agents() -> dict[str, ap.Agent]:
    out = {}
    for agent in load_catalog(TEST_CATALOG):
        agent.effective_subagent_config.CopyFrom(effective_subagent_config(agent, GLOBAL))
        out[agent.slug] = agent
    return out


def test_a_tool_is_shown_only_when_both_layers_agree() -> None:
    registry = build_registry()
    catalog = agents()
    for agent in catalog.values():
        for role in ROLES:
            handlers = registry.handlers(role)
            resolved = registry.resolve(agent, role)
            assert set(resolved) <= set(handlers), "a visible tool always has a handler"
            assert set(resolved) == {n for n in registry.visible(agent, role) if n in handlers}
            if role != SUPERVISOR:
                assert not {"delegate_task", "delegate_parallel"} & set(resolved)
                assert "delegate_task" not in handlers, "subagents and callees have no delegate handler"
    assert "clarify" not in registry.handlers(SUBAGENT) and "clarify" not in registry.handlers(A2A_CALLEE)
    assert set(registry.resolve(catalog["solo"], SUPERVISOR)) == {"agent-invoke"}, "subagents disabled"
    assert set(registry.resolve(catalog["general"], SUPERVISOR)) >= {
        "delegate_task",
        "delegate_parallel",
        "clarify",
    }
    assert set(registry.resolve(catalog["helper"], SUBAGENT)) == {"agent-invoke"}, (
        "blocked tools never reach it"
    )
    assert registry.resolve(catalog["general"], SUPERVISOR, allow=[]) == {}, "an empty allow-list means none"
    assert set(registry.resolve(catalog["general"], SUPERVISOR, allow=["clarify", "nope"])) == {"clarify"}


class _Agents:
    def __init__(self, known: dict[str, ap.Agent]) -> None:
        self.known = known

    async def find(self, slug: str) -> ap.Agent | None:
        return self.known.get(slug)


def ctx(agent: ap.Agent, known: dict[str, ap.Agent]) -> ToolContext:
    return ToolContext(
        agent=agent,
        role=SUPERVISOR,
        trace_id="t",
        anchor_message_id=1,
        depth=0,
        tool_call_id="c",
        sink=None,  # type: ignore[arg-type]
        clients=None,  # type: ignore[arg-type]
        settings=None,  # type: ignore[arg-type]
        agents=_Agents(known),  # type: ignore[arg-type]
        state=RunState(),
        leases=None,  # type: ignore[arg-type]
    )


async def test_planning_a_delegate_task() -> None:
    catalog = agents()
    general = ctx(catalog["general"], catalog)
    preset = await subagents._plan(general, {"goal": "g", "agentSlug": "coder", "toolNames": ["clarify"]})
    assert (
        preset.source == ev.SUBAGENT_SOURCE_PRESET
        and preset.agent.slug == "coder"
        and preset.name == "Coding Assistant"
    )
    assert preset.tool_names == [], "clarify is blocked for every subagent"
    clone = await subagents._plan(general, {"goal": "g", "mode": "clone", "maxToolRounds": 2})
    assert (
        clone.source == ev.SUBAGENT_SOURCE_CLONE
        and clone.agent is catalog["general"]
        and clone.max_steps == 3
    )
    assert clone.name == "General Assistant (clone)" and clone.tool_names is None
    bad: list[tuple[Any, str]] = [
        ("not a dict", "must be an object"),
        ({"agentSlug": "coder"}, "goal is required"),
        ({"goal": "g", "agentSlug": "secret"}, "not allowed"),
        ({"goal": "g", "agentSlug": "nobody"}, "unknown preset agent"),
        ({"goal": "g", "mode": "twin"}, "mode must be"),
    ]
    for task, needle in bad:
        with pytest.raises(InvalidArgument, match=needle):
            await subagents._plan(general, task)
