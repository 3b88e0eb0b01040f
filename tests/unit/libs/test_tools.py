"""libs/tools.py: the tool vocabulary the runtime's registry and the trace service share."""

from __future__ import annotations

import pytest

from agentmesh.libs import tools
from agentmesh.libs.tools import A2A_CALLEE, BUILTIN, SUBAGENT, SUPERVISOR, ToolCatalog, ToolSpec
from agentmesh.services.agent_runtime.builtin_tools import register_all
from agentmesh.services.agent_runtime.tools import ToolRegistry


def test_choosable_tools_per_role():
    blocked = ["delegate_task", "delegate_parallel", "clarify", "memory_save"]
    assert BUILTIN.choosable(SUPERVISOR, blocked) == [
        "agent-invoke",
        "delegate_task",
        "delegate_parallel",
        "clarify",
    ]
    assert BUILTIN.choosable(SUBAGENT, blocked) == ["agent-invoke"]
    assert BUILTIN.choosable(SUBAGENT, ["agent-invoke"]) == [], "the mesh's blocked list applies"
    assert BUILTIN.choosable(A2A_CALLEE, []) == ["agent-invoke"], "a callee never delegates or asks"


def test_the_runtime_binds_a_handler_to_every_tool_and_only_to_those():
    registry = ToolRegistry()
    register_all(registry)
    for role in tools.ROLES:
        assert set(registry.handlers(role)) == set(BUILTIN.instantiated(role))
    incomplete = ToolRegistry(
        ToolCatalog([*BUILTIN.specs.values(), ToolSpec("extra", "x", {}, (SUPERVISOR,))])
    )
    with pytest.raises(RuntimeError, match="tools without a handler: extra"):
        register_all(incomplete)
    with pytest.raises(ValueError, match="no tool 'nope'"):
        registry.bind("nope", lambda ctx, args: None)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="declared twice"):
        ToolCatalog([tools.CLARIFY, tools.CLARIFY])


def test_the_background_tools_come_with_the_delegate_tools():
    from agentmesh.agents.v1 import agent_pb2 as ap

    def agent(tool_names: list[str], enabled: bool = True) -> ap.Agent:
        a = ap.Agent(slug="a", tools=tool_names)
        a.effective_subagent_config.enabled = enabled
        return a

    background = list(tools.BACKGROUND_TOOLS)
    assert BUILTIN.visible(agent(["delegate_task"]), SUPERVISOR) == ["delegate_task", *background]
    assert BUILTIN.visible(agent(["clarify"]), SUPERVISOR) == ["clarify"], "no delegation, no handles"
    assert BUILTIN.visible(agent(["delegate_task"], enabled=False), SUPERVISOR) == []
    assert BUILTIN.visible(agent(["delegate_task", *background]), A2A_CALLEE) == []
