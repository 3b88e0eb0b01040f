"""Agents as data: the catalog file (the built-in set), the JSON form of an agent, its defaults and
validation, and the effective subagent config (agent > global default > system fallback, seed 3
section 6.1). The trace service is the only process that reads the catalog file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format, struct_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from libs.config import SubagentDefaults
from libs.errors import InvalidArgument

SLUG = re.compile(r"[a-z0-9][a-z0-9_-]{0,99}")
DEFAULT_LIMITS = ap.Limits(max_steps=8, max_output_tokens=4096, timeout_ms=120_000)
DEFAULT_INVOKE = ap.InvokeConfig(
    max_recursion_depth=3, timeout_ms=60_000, max_output_tokens=2048, max_parallel=4
)
SYSTEM_FALLBACK = ap.EffectiveSubagentConfig(enabled=False, max_concurrent=1, timeout_ms=60_000)
OUTPUT_ONLY = ("effective_subagent_config", "owner", "version", "create_time", "update_time")


def _names(values: struct_pb2.ListValue, what: str) -> list[str]:
    out = []
    for v in values.values:
        if v.WhichOneof("kind") != "string_value":
            raise InvalidArgument(f"{what} must be a list of strings")
        out.append(v.string_value)
    return out


def from_json(data: Any, where: str = "agent") -> ap.Agent:
    """An agent from its JSON form (camelCase or snake_case keys), with defaults, validated.
    Output-only fields are ignored."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"{where}: an agent is a JSON object")
    data = {k: v for k, v in data.items() if k not in _IGNORED}
    # The defaults first, the given keys on top: a given 0 is a value (invoke.maxRecursionDepth: 0
    # forbids agent-invoke), not "unset".
    agent = ap.Agent(limits=DEFAULT_LIMITS, invoke=DEFAULT_INVOKE)
    try:
        json_format.ParseDict(data, agent)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"{where}: {exc}") from exc
    for name, defaults in (("limits", DEFAULT_LIMITS), ("invoke", DEFAULT_INVOKE)):
        if not agent.HasField(name):  # given as null
            getattr(agent, name).CopyFrom(defaults)
    agent.system_prompt = agent.system_prompt or "You are a helpful assistant."
    agent.model = agent.model or "mock-gpt"
    validate(agent, where)
    return agent


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


_IGNORED = frozenset(OUTPUT_ONLY) | {_camel(name) for name in OUTPUT_ONLY}


def validate(agent: ap.Agent, where: str = "agent") -> None:
    """Shape rules every agent obeys (the catalog's and users' alike)."""
    if not SLUG.fullmatch(agent.slug):
        raise InvalidArgument(f"{where}: slug must be 1-100 characters of [a-z0-9_-]")
    if not agent.name.strip() or len(agent.name) > 200:
        raise InvalidArgument(f"{where}: name must be 1-200 characters")
    if len(agent.system_prompt) > 100_000:
        raise InvalidArgument(f"{where}: systemPrompt is at most 100000 characters")
    limits, invoke = agent.limits, agent.invoke
    for name, value, low, high in (
        ("limits.maxSteps", limits.max_steps, 1, 100),
        ("limits.maxOutputTokens", limits.max_output_tokens, 1, 1_000_000),
        ("limits.timeoutMs", limits.timeout_ms, 100, 3_600_000),
        ("invoke.maxRecursionDepth", invoke.max_recursion_depth, 0, 10),
        ("invoke.timeoutMs", invoke.timeout_ms, 100, 3_600_000),
        ("invoke.maxOutputTokens", invoke.max_output_tokens, 1, 1_000_000),
        ("invoke.maxParallel", invoke.max_parallel, 1, 32),
    ):
        if not low <= value <= high:
            raise InvalidArgument(f"{where}: {name} must be {low}-{high}")
    sub = agent.subagent_config
    if sub.HasField("max_concurrent") and not 1 <= sub.max_concurrent <= 16:
        raise InvalidArgument(f"{where}: subagentConfig.maxConcurrent must be 1-16")
    if sub.HasField("timeout_ms") and not 100 <= sub.timeout_ms <= 3_600_000:
        raise InvalidArgument(f"{where}: subagentConfig.timeoutMs must be 100-3600000")
    for field in ("allowed_preset_agent_ids", "allowed_tool_names"):
        if sub.HasField(field):
            _names(getattr(sub, field), f"{where}: subagentConfig.{_camel(field)}")


def to_json(agent: ap.Agent) -> dict[str, Any]:
    """The stored form of an agent's own settings (no output-only fields)."""
    stored = ap.Agent()
    stored.CopyFrom(agent)
    for name in OUTPUT_ONLY:
        stored.ClearField(name)
    out = json_format.MessageToDict(stored)
    for name in ("limits", "invoke"):  # zeros too, or from_json would read them back as the defaults
        sub, given = getattr(stored, name), out.setdefault(_camel(name), {})
        for field in sub.DESCRIPTOR.fields:
            if not field.is_repeated:
                given.setdefault(field.json_name, getattr(sub, field.name))
    return out


def load_catalog(path: Path | str) -> list[ap.Agent]:
    """The built-in agents of a catalog file (`agents: [...]`); InvalidArgument naming what is wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidArgument(f"bad agent catalog {path}: {exc}") from exc
    if not isinstance(data, dict) or not isinstance(data.get("agents"), list):
        raise InvalidArgument(f"bad agent catalog {path}: expected `agents:` with a list")
    agents = [from_json(a, f"agent catalog {path}, agent {i + 1}") for i, a in enumerate(data["agents"])]
    slugs = [a.slug for a in agents]
    if len(slugs) != len(set(slugs)):
        raise InvalidArgument(f"bad agent catalog {path}: duplicate slugs")
    return agents


def effective_subagent_config(
    agent: ap.Agent, defaults: SubagentDefaults | None
) -> ap.EffectiveSubagentConfig:
    """Agent override > global default (mesh config) > system fallback (seed 3 section 6.1)."""
    own = agent.subagent_config
    out = ap.EffectiveSubagentConfig()
    out.enabled = own.enabled if own.HasField("enabled") else (defaults.enabled if defaults else False)
    out.max_concurrent = max(
        1,
        own.max_concurrent
        if own.HasField("max_concurrent")
        else (defaults.max_concurrent if defaults else SYSTEM_FALLBACK.max_concurrent),
    )
    out.timeout_ms = (
        own.timeout_ms
        if own.HasField("timeout_ms")
        else (defaults.timeout_ms if defaults else SYSTEM_FALLBACK.timeout_ms)
    )
    if own.HasField("allowed_preset_agent_ids"):
        out.allowed_preset_agent_ids.CopyFrom(own.allowed_preset_agent_ids)
    if own.HasField("allowed_tool_names"):
        out.allowed_tool_names.CopyFrom(own.allowed_tool_names)
    out.blocked_tool_names.extend((defaults or SubagentDefaults()).blocked_tool_names)
    return out
