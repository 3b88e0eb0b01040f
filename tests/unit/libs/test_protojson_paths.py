"""libs.protojson.given_paths: the field mask of a JSON merge patch."""

from __future__ import annotations

from agentmesh.agents.v1 import agent_pb2 as ap
from libs.protojson import given_paths


def test_given_paths():
    body = {
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
