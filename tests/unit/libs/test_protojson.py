"""libs.protojson: the field mask of a JSON merge patch (given_paths); optional fields in to_json."""

from __future__ import annotations

from typing import Any

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.protojson import given_paths, to_json


def test_given_paths():
    body: dict[str, Any] = {
        "systemPrompt": "x",
        "limits": {"maxSteps": 3, "timeoutMs": 100},
        "invoke": None,
        "subagentConfig": {"allowedToolNames": [], "enabled": None},
        "tools": ["a"],
        "effectiveSubagentConfig": {},
        "nope": 1,
        "max_steps": 2,
    }
    assert given_paths(body, ap.Agent.DESCRIPTOR) == [
        "system_prompt",
        "limits.max_steps",
        "limits.timeout_ms",
        "invoke",
        "subagent_config.allowed_tool_names",
        "subagent_config.enabled",
        "tools",
        "nope",
        "max_steps",
    ]
    assert given_paths({"system_prompt": "snake too"}, ap.Agent.DESCRIPTOR) == ["system_prompt"]


def test_an_unset_optional_field_stays_absent():
    agent = ap.Agent()
    agent.subagent_config.enabled = False
    assert to_json(agent)["subagentConfig"] == {"enabled": False}, "set: even its default is given"
    agent.subagent_config.max_concurrent = 0
    assert to_json(agent)["subagentConfig"] == {"enabled": False, "maxConcurrent": 0}
    assert to_json(ap.Limits()) == {"maxSteps": 0, "maxOutputTokens": 0, "timeoutMs": 0}, (
        "plain fields: always"
    )
