"""The runtime's limits: agent-invoke parallelism, delegate batch size, model steps per run."""

from __future__ import annotations

from typing import Any

import pytest

from tests.mesh import TEST_CATALOG, Mesh, chat

pytestmark = pytest.mark.mesh(catalog=TEST_CATALOG, rules={"rules": []})


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "rules": [
            {
                "system": r"\[general\]",
                "after_tool": False,
                "tool_calls": [{"name": name, "arguments": arguments}],
            },
            {"system": r"\[general\]", "after_tool": True, "text": "{tool_results}"},
        ]
    }


async def test_agent_invoke_parallel_limit(mesh: Mesh) -> None:
    mesh.mock.set_rules(tool_call("agent-invoke", {"agentSlug": "coder", "input": ["a", "b", "c", "d"]}))
    events = await chat(mesh, "general", "too many")
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and "at most 3" in out["output"]["error"]
    assert out["output"]["code"] == "invalid_argument"
    assert "a2a-task-started" not in [e["type"] for e in events]


async def test_delegate_batch_size_limit(mesh: Mesh) -> None:
    mesh.mock.set_rules(tool_call("delegate_parallel", {"tasks": [{"goal": f"g{i}"} for i in range(11)]}))
    events = await chat(mesh, "general", "too many subtasks")
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and "between 1 and 10" in out["output"]["error"]
    assert not [e for e in events if e["type"].startswith("subagent-")]


async def test_run_step_limit(mesh: Mesh) -> None:
    """A model that never stops calling tools ends at the agent's step limit (maxSteps)."""
    mesh.mock.set_rules(
        {
            "rules": [
                {
                    "system": r"\[general\]",
                    "tool_calls": [
                        {"name": "agent-invoke", "arguments": {"agentSlug": "ghost", "input": "x"}}
                    ],
                }
            ]
        }
    )
    events = await chat(mesh, "general", "loop forever")
    assert events[-2]["type"] == "finish" and events[-2]["finishReason"] == "max-steps"
    assert sum(1 for e in events if e["type"] == "tool-input-available") == 8
