"""services/trace/agents.py: the JSON form of an agent (defaults, key styles, validation), the catalog
file, and the effective subagent config (agent > global default > system fallback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf import struct_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.tools import BUILTIN
from agentmesh.services.trace import agents

DEMO_CATALOG = Path(agents.__file__).parent / "demo_catalog.yaml"
MINIMAL = {"slug": "x", "name": "X"}


def _names(*names: str) -> struct_pb2.ListValue:
    out = struct_pb2.ListValue()
    out.extend(names)
    return out


def _refused(data: Any, message: str, where: str = "agent") -> None:
    with pytest.raises(InvalidArgument) as caught:
        agents.from_json(data, where)
    assert caught.value.message == message


# ---- from_json ---------------------------------------------------------------------------------------


def test_from_json_fills_defaults():
    agent = agents.from_json(MINIMAL)
    assert agent == ap.Agent(
        slug="x",
        name="X",
        system_prompt="You are a helpful assistant.",
        model="mock-gpt",
        limits=agents.DEFAULT_LIMITS,
        invoke=agents.DEFAULT_INVOKE,
    )
    assert agent.limits == ap.Limits(max_steps=8, max_output_tokens=4096, timeout_ms=120_000)
    assert agent.invoke == ap.InvokeConfig(
        max_recursion_depth=3, timeout_ms=60_000, max_output_tokens=2048, max_parallel=4
    )
    # Nothing of the subagent config is set: every field falls back to the mesh's.
    assert not agent.HasField("subagent_config")


def test_from_json_keeps_given_values_and_fills_the_rest():
    agent = agents.from_json(
        {
            **MINIMAL,
            "limits": {"maxSteps": 3},
            "invoke": {"allowedCallees": ["a"], "maxRecursionDepth": 0},
            "systemPrompt": "Be brief.",
            "model": "other",
        }
    )
    assert agent.limits == ap.Limits(max_steps=3, max_output_tokens=4096, timeout_ms=120_000)
    # A given zero is a value: maxRecursionDepth 0 forbids agent-invoke.
    assert agent.invoke == ap.InvokeConfig(
        allowed_callees=["a"],
        max_recursion_depth=0,
        timeout_ms=60_000,
        max_output_tokens=2048,
        max_parallel=4,
    )
    assert (agent.system_prompt, agent.model) == ("Be brief.", "other")


def test_from_json_null_sections_take_the_defaults():
    agent = agents.from_json({**MINIMAL, "limits": None, "invoke": {}, "systemPrompt": ""})
    assert (agent.limits, agent.invoke) == (agents.DEFAULT_LIMITS, agents.DEFAULT_INVOKE)
    assert agent.system_prompt == "You are a helpful assistant."


def test_from_json_reads_camel_and_snake_case_keys():
    camel = {
        "slug": "both",
        "name": "Both",
        "systemPrompt": "p",
        "limits": {"maxSteps": 4, "maxOutputTokens": 100, "timeoutMs": 5000},
        "invoke": {"allowedCallees": ["a"], "maxRecursionDepth": 2, "timeoutMs": 900, "maxParallel": 2},
        "subagentConfig": {
            "enabled": True,
            "maxConcurrent": 2,
            "allowedPresetAgentIds": ["a"],
            "allowedToolNames": ["t"],
            "timeoutMs": 1000,
        },
    }
    snake = {
        "slug": "both",
        "name": "Both",
        "system_prompt": "p",
        "limits": {"max_steps": 4, "max_output_tokens": 100, "timeout_ms": 5000},
        "invoke": {"allowed_callees": ["a"], "max_recursion_depth": 2, "timeout_ms": 900, "max_parallel": 2},
        "subagent_config": {
            "enabled": True,
            "max_concurrent": 2,
            "allowed_preset_agent_ids": ["a"],
            "allowed_tool_names": ["t"],
            "timeout_ms": 1000,
        },
    }
    assert agents.from_json(camel) == agents.from_json(snake)
    sub = agents.from_json(camel).subagent_config
    assert (sub.enabled, sub.max_concurrent, sub.timeout_ms) == (True, 2, 1000)
    assert (sub.allowed_preset_agent_ids, sub.allowed_tool_names) == (_names("a"), _names("t"))


def test_from_json_ignores_output_only_fields():
    given = {
        **MINIMAL,
        "owner": "mallory",
        "version": 99,
        "createTime": "2026-01-01T00:00:00Z",
        "update_time": "2026-01-01T00:00:00Z",
        "effectiveSubagentConfig": {"enabled": True, "maxConcurrent": 16},
        "effective_subagent_config": {"enabled": True},
    }
    assert agents.from_json(given) == agents.from_json(MINIMAL)


def test_empty_name_lists_are_kept_apart_from_absent_ones():
    empty = agents.from_json({**MINIMAL, "subagentConfig": {"allowedToolNames": []}}).subagent_config
    assert empty.HasField("allowed_tool_names") and list(empty.allowed_tool_names.values) == []
    assert not empty.HasField("allowed_preset_agent_ids") and not empty.HasField("enabled")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([MINIMAL], "agent: an agent is a JSON object"),
        ("x", "agent: an agent is a JSON object"),
        (None, "agent: an agent is a JSON object"),
        ({"name": "X"}, "agent: slug must be 1-100 characters of [a-z0-9_-]"),
        ({"slug": "Bad", "name": "X"}, "agent: slug must be 1-100 characters of [a-z0-9_-]"),
        ({"slug": "with space", "name": "X"}, "agent: slug must be 1-100 characters of [a-z0-9_-]"),
        ({"slug": "-lead", "name": "X"}, "agent: slug must be 1-100 characters of [a-z0-9_-]"),
        ({"slug": "x" * 101, "name": "X"}, "agent: slug must be 1-100 characters of [a-z0-9_-]"),
        ({"slug": "x"}, "agent: name must be 1-200 characters"),
        ({"slug": "x", "name": "  "}, "agent: name must be 1-200 characters"),
        ({"slug": "x", "name": "n" * 201}, "agent: name must be 1-200 characters"),
        ({**MINIMAL, "systemPrompt": "p" * 100_001}, "agent: systemPrompt is at most 100000 characters"),
        ({**MINIMAL, "limits": {"maxSteps": 101}}, "agent: limits.maxSteps must be 1-100"),
        ({**MINIMAL, "limits": {"maxSteps": -1}}, "agent: limits.maxSteps must be 1-100"),
        ({**MINIMAL, "limits": {"maxSteps": 0}}, "agent: limits.maxSteps must be 1-100"),
        (
            {**MINIMAL, "limits": {"maxOutputTokens": 1_000_001}},
            "agent: limits.maxOutputTokens must be 1-1000000",
        ),
        ({**MINIMAL, "limits": {"timeoutMs": 99}}, "agent: limits.timeoutMs must be 100-3600000"),
        ({**MINIMAL, "limits": {"timeoutMs": 3_600_001}}, "agent: limits.timeoutMs must be 100-3600000"),
        ({**MINIMAL, "invoke": {"maxRecursionDepth": 11}}, "agent: invoke.maxRecursionDepth must be 0-10"),
        ({**MINIMAL, "invoke": {"maxRecursionDepth": -1}}, "agent: invoke.maxRecursionDepth must be 0-10"),
        ({**MINIMAL, "invoke": {"timeoutMs": 50}}, "agent: invoke.timeoutMs must be 100-3600000"),
        ({**MINIMAL, "invoke": {"maxOutputTokens": -5}}, "agent: invoke.maxOutputTokens must be 1-1000000"),
        ({**MINIMAL, "invoke": {"maxParallel": 33}}, "agent: invoke.maxParallel must be 1-32"),
        ({**MINIMAL, "invoke": {"maxParallel": 0}}, "agent: invoke.maxParallel must be 1-32"),
        (
            {**MINIMAL, "subagentConfig": {"maxConcurrent": 0}},
            "agent: subagentConfig.maxConcurrent must be 1-16",
        ),
        (
            {**MINIMAL, "subagentConfig": {"maxConcurrent": 17}},
            "agent: subagentConfig.maxConcurrent must be 1-16",
        ),
        (
            {**MINIMAL, "subagentConfig": {"timeoutMs": 99}},
            "agent: subagentConfig.timeoutMs must be 100-3600000",
        ),
        (
            {**MINIMAL, "subagentConfig": {"allowedToolNames": ["ok", 1]}},
            "agent: subagentConfig.allowedToolNames must be a list of strings",
        ),
        (
            {**MINIMAL, "subagentConfig": {"allowedToolNames": [None]}},
            "agent: subagentConfig.allowedToolNames must be a list of strings",
        ),
        (
            {**MINIMAL, "subagentConfig": {"allowedToolNames": [["nested"]]}},
            "agent: subagentConfig.allowedToolNames must be a list of strings",
        ),
        (
            {**MINIMAL, "subagentConfig": {"allowedPresetAgentIds": [True]}},
            "agent: subagentConfig.allowedPresetAgentIds must be a list of strings",
        ),
    ],
)
def test_from_json_refuses(data, message):
    _refused(data, message)


@pytest.mark.parametrize(
    "data",
    [
        {**MINIMAL, "colour": "blue"},  # unknown key
        {**MINIMAL, "limits": {"maxSteps": "many"}},
        {**MINIMAL, "tools": "search"},
        {**MINIMAL, "subagentConfig": {"enabled": "yes"}},
        {**MINIMAL, "subagentConfig": {"allowedToolNames": "search"}},
    ],
)
def test_from_json_refuses_what_does_not_parse(data):
    with pytest.raises(InvalidArgument) as caught:
        agents.from_json(data, "catalog, agent 3")
    assert caught.value.message.startswith("catalog, agent 3: ")


def test_to_json_round_trip_drops_output_only_fields():
    agent = agents.from_json(
        {
            **MINIMAL,
            "description": "d",
            "tools": ["search"],
            "public": True,
            "invoke": {"maxRecursionDepth": 0, "allowedCallees": ["*"]},
            "subagentConfig": {"enabled": False, "allowedToolNames": []},
        }
    )
    served = ap.Agent()
    served.CopyFrom(agent)
    served.owner, served.version = "alice", 7
    served.create_time.GetCurrentTime()
    served.effective_subagent_config.enabled = True
    stored = agents.to_json(served)
    assert not {"owner", "version", "createTime", "updateTime", "effectiveSubagentConfig"} & set(stored)
    assert stored["invoke"]["maxRecursionDepth"] == 0  # kept, not read back as the default
    assert stored["subagentConfig"] == {"enabled": False, "allowedToolNames": []}
    assert agents.from_json(stored) == agent


# ---- the catalog file --------------------------------------------------------------------------------


def test_load_catalog_of_the_demo():
    catalog = agents.load_catalog(DEMO_CATALOG)
    assert [a.slug for a in catalog] == ["general", "coder", "researcher"]
    general = catalog[0]
    assert (general.name, general.model, list(general.tools)) == (
        "General Assistant",
        "mock-gpt",
        ["agent-invoke", "delegate_task", "delegate_parallel"],
    )
    assert list(general.invoke.allowed_callees) == ["coder", "researcher"]
    sub = general.subagent_config
    assert (sub.enabled, sub.max_concurrent, sub.allowed_preset_agent_ids) == (
        True,
        3,
        _names("coder", "researcher"),
    )
    assert not sub.HasField("timeout_ms") and not sub.HasField("allowed_tool_names")
    assert catalog[1].limits == agents.DEFAULT_LIMITS and catalog[1].subagent_config == ap.SubagentConfig()
    assert agents.load_catalog(str(DEMO_CATALOG)) == catalog  # a str path too


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("agents: [", "bad agent catalog {path}: "),  # not YAML
        ("", "bad agent catalog {path}: expected `agents:` with a list"),
        ("- slug: x", "bad agent catalog {path}: expected `agents:` with a list"),
        ("agents: {slug: x}", "bad agent catalog {path}: expected `agents:` with a list"),
        ("agentz: []", "bad agent catalog {path}: expected `agents:` with a list"),
        (
            "agents:\n  - {slug: a, name: A}\n  - {slug: a, name: B}",
            "bad agent catalog {path}: duplicate slugs",
        ),
        (
            "agents:\n  - {slug: a, name: A}\n  - {slug: B, name: B}",
            "agent catalog {path}, agent 2: slug must be 1-100 characters of [a-z0-9_-]",
        ),
        (
            "agents:\n  - {slug: a, name: A, limits: {maxSteps: 1000}}",
            "agent catalog {path}, agent 1: limits.maxSteps must be 1-100",
        ),
        ("agents:\n  - just a string", "agent catalog {path}, agent 1: an agent is a JSON object"),
    ],
)
def test_load_catalog_refuses_a_bad_file(tmp_path, text, message):
    path = tmp_path / "catalog.yaml"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as caught:
        agents.load_catalog(path)
    assert caught.value.message.startswith(message.format(path=path))


def test_load_catalog_of_a_missing_file(tmp_path):
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(InvalidArgument) as caught:
        agents.load_catalog(missing)
    assert caught.value.message.startswith(f"bad agent catalog {missing}: ")


def test_an_empty_catalog_has_no_agents(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text("agents: []")
    assert agents.load_catalog(path) == []


# ---- the effective subagent config -------------------------------------------------------------------

PRIORITY_CATALOG = """
agents:
  - slug: general
    name: General
    subagentConfig: {enabled: true, maxConcurrent: 2, allowedPresetAgentIds: [coder, helper]}
  - slug: defaults
    name: Defaults
  - slug: solo
    name: Solo
    subagentConfig: {enabled: false}
  - slug: strict
    name: Strict
    subagentConfig: {timeoutMs: 5000, allowedToolNames: []}
"""
GLOBAL = SubagentDefaults(max_concurrent=3, timeout_ms=20000)


@pytest.fixture
def catalog(tmp_path) -> dict[str, ap.Agent]:
    path = tmp_path / "catalog.yaml"
    path.write_text(PRIORITY_CATALOG)
    return {a.slug: a for a in agents.load_catalog(path)}


def test_config_priority(catalog):
    """The rules of the old test_config_priority_and_tool_layers, field by field."""
    general, defaults, solo, strict = (catalog[s] for s in ("general", "defaults", "solo", "strict"))
    eff = agents.effective_subagent_config
    assert eff(general, GLOBAL).max_concurrent == 2  # agent override
    assert eff(defaults, GLOBAL).max_concurrent == 3  # global default
    assert eff(defaults, None).max_concurrent == 1  # system fallback
    assert eff(defaults, None).enabled is False
    assert eff(defaults, GLOBAL).enabled is True
    assert eff(solo, GLOBAL).enabled is False
    assert eff(general, None).enabled is True
    assert eff(strict, GLOBAL).timeout_ms == 5000
    assert eff(defaults, GLOBAL).timeout_ms == 20000
    assert eff(defaults, None).timeout_ms == agents.SYSTEM_FALLBACK.timeout_ms == 60_000


def test_effective_config_whole(catalog):
    blocked = SubagentDefaults().blocked_tool_names
    assert agents.effective_subagent_config(catalog["general"], GLOBAL) == ap.EffectiveSubagentConfig(
        enabled=True,
        max_concurrent=2,
        allowed_preset_agent_ids=_names("coder", "helper"),
        blocked_tool_names=blocked,
        timeout_ms=20000,
    )
    assert agents.effective_subagent_config(catalog["defaults"], None) == ap.EffectiveSubagentConfig(
        enabled=False, max_concurrent=1, blocked_tool_names=blocked, timeout_ms=60_000
    )
    strict = agents.effective_subagent_config(catalog["strict"], GLOBAL)
    assert strict.HasField("allowed_tool_names") and list(strict.allowed_tool_names.values) == []  # "none"
    assert not strict.HasField("allowed_preset_agent_ids")  # "not configured": any preset agent
    # The blocked tools are the mesh's list, never the agent's.
    mesh = SubagentDefaults(blocked_tool_names=["clarify"], max_concurrent=0)
    own = agents.effective_subagent_config(catalog["defaults"], mesh)
    assert list(own.blocked_tool_names) == ["clarify"]
    assert own.max_concurrent == 1  # at least one at a time


# ---- a user's writes ---------------------------------------------------------------------------------


def test_check_references():
    known = {"coder", "general"}
    blocked = ["clarify"]
    fine = agents.from_json(
        {
            **MINIMAL,
            "tools": ["agent-invoke", "clarify"],
            "invoke": {"allowedCallees": ["*", "x", "coder"]},
            "subagentConfig": {
                "allowedPresetAgentIds": ["general", "x"],
                "allowedToolNames": ["agent-invoke"],
            },
        }
    )
    agents.check_references(fine, known, BUILTIN, blocked)
    refused: list[tuple[dict[str, Any], str]] = [
        ({"tools": ["shell"]}, "tools: unknown tool 'shell'"),
        ({"invoke": {"allowedCallees": ["ghost"]}}, "invoke.allowedCallees: unknown agent 'ghost'"),
        (
            {"subagentConfig": {"allowedPresetAgentIds": ["ghost"]}},
            "subagentConfig.allowedPresetAgentIds: unknown agent 'ghost'",
        ),
        (
            {"subagentConfig": {"allowedToolNames": ["clarify"]}},
            "subagentConfig.allowedToolNames: 'clarify' is blocked for every subagent by the mesh",
        ),
        (  # not blocked by this mesh, but it has no handler in subagents
            {"subagentConfig": {"allowedToolNames": ["delegate_task"]}},
            "subagentConfig.allowedToolNames: 'delegate_task' does not run in subagents",
        ),
    ]
    for fields, message in refused:
        agent = agents.from_json({**MINIMAL, **fields})
        with pytest.raises(InvalidArgument) as caught:
            agents.check_references(agent, known, BUILTIN, blocked)
        assert caught.value.message.startswith(message), fields


def test_merged_takes_the_masked_fields():
    base = agents.normalized(
        agents.from_json({**MINIMAL, "limits": {"maxSteps": 3}, "subagentConfig": {"enabled": True}})
    )
    given = ap.Agent(slug="x", system_prompt="new", limits=ap.Limits(max_steps=9))
    out = agents.merged(base, given, ["system_prompt", "limits.max_steps", "subagent_config", "version"])
    assert (out.system_prompt, out.limits.max_steps, out.limits.timeout_ms) == ("new", 9, 120_000)
    assert not out.HasField("subagent_config"), "a masked field left unset is reset"
    assert agents.merged(base, ap.Agent(slug="x"), ["limits"]).limits == agents.DEFAULT_LIMITS
    with pytest.raises(InvalidArgument, match=r"unknown field 'limits\.nope'"):
        agents.merged(base, given, ["limits.nope"])
    with pytest.raises(InvalidArgument, match="slug cannot change"):
        agents.merged(base, ap.Agent(slug="y"), ["slug"])
    assert agents.merged(base, ap.Agent(slug="y", name="Y"), ["slug", "name"], new=True).slug == "y"


def test_free_slug():
    assert agents.free_slug("general", {"general"}) == "general-copy"
    assert agents.free_slug("general", {"general-copy", "general-copy-2"}) == "general-copy-3"
    assert agents.SLUG.fullmatch(agents.free_slug("a" * 100, set()))
