"""Agents as data: the catalog file (the built-in set), the JSON form of an agent, its defaults and
validation, the rules of a user's write (the tools, callees and presets it names exist; masks), and
the effective subagent config (agent > global default > system fallback,
docs/requirements.md#subagent-config-priority). The
trace service is the only process that reads the catalog file."""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import yaml
from google.protobuf import field_mask_pb2, json_format, struct_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import SLUG_PATTERN
from agentmesh.libs.tools import SUBAGENT, ToolCatalog, names

SLUG = re.compile(SLUG_PATTERN)
REMOTE_URL = re.compile(r"https?://[^\s/?#@]+(/[^\s#]*)?", re.ASCII)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,127}", re.ASCII)
DEFAULT_LIMITS = ap.Limits(max_steps=8, max_output_tokens=4096, timeout_ms=120_000)
DEFAULT_INVOKE = ap.InvokeConfig(
    max_recursion_depth=3, timeout_ms=60_000, max_output_tokens=2048, max_parallel=4
)
SYSTEM_FALLBACK = ap.EffectiveSubagentConfig(enabled=False, max_concurrent=1, timeout_ms=60_000)
OUTPUT_ONLY = ("effective_subagent_config", "owner", "version", "create_time", "update_time")
WRITABLE = tuple(f.name for f in ap.Agent.DESCRIPTOR.fields if f.name not in OUTPUT_ONLY)
ANY_CALLEE = "*"


class Range(NamedTuple):
    """The allowed values of one number of an agent (an optional one is checked only when set)."""

    field: str  # its JSON path
    message: str  # the Agent field holding it
    name: str  # its field there
    min: int
    max: int


RANGES = (
    Range("limits.maxSteps", "limits", "max_steps", 1, 100),
    Range("limits.maxOutputTokens", "limits", "max_output_tokens", 1, 1_000_000),
    Range("limits.timeoutMs", "limits", "timeout_ms", 100, 3_600_000),
    Range("invoke.maxRecursionDepth", "invoke", "max_recursion_depth", 0, 10),
    Range("invoke.timeoutMs", "invoke", "timeout_ms", 100, 3_600_000),
    Range("invoke.maxOutputTokens", "invoke", "max_output_tokens", 1, 1_000_000),
    Range("invoke.maxParallel", "invoke", "max_parallel", 1, 32),
    Range("subagentConfig.maxConcurrent", "subagent_config", "max_concurrent", 1, 16),
    Range("subagentConfig.timeoutMs", "subagent_config", "timeout_ms", 100, 3_600_000),
)


def _at(where: str) -> str:
    """The prefix of a message about `where` ("" for a user's own write: its fields say enough)."""
    return f"{where}: " if where else ""


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
        raise InvalidArgument(f"{_at(where)}an agent is a JSON object")
    data = {k: v for k, v in data.items() if k not in _IGNORED}
    # The defaults first, the given keys on top: a given 0 is a value (invoke.maxRecursionDepth: 0
    # forbids agent-invoke), not "unset".
    agent = ap.Agent(limits=DEFAULT_LIMITS, invoke=DEFAULT_INVOKE)
    try:
        json_format.ParseDict(data, agent)
    except json_format.ParseError as exc:
        raise InvalidArgument(f"{_at(where)}{exc}") from exc
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
        raise InvalidArgument(f"{_at(where)}slug must be 1-100 characters of [a-z0-9_-]")
    if not agent.name.strip() or len(agent.name) > 200:
        raise InvalidArgument(f"{_at(where)}name must be 1-200 characters")
    if len(agent.description) > 10_000:
        raise InvalidArgument(f"{_at(where)}description is at most 10000 characters")
    if len(agent.system_prompt) > 100_000:
        raise InvalidArgument(f"{_at(where)}systemPrompt is at most 100000 characters")
    if len(agent.model) > 200:
        raise InvalidArgument(f"{_at(where)}model is at most 200 characters")
    for r in RANGES:
        holder = getattr(agent, r.message)
        if holder.DESCRIPTOR.fields_by_name[r.name].has_presence and not holder.HasField(r.name):
            continue
        if not r.min <= getattr(holder, r.name) <= r.max:
            raise InvalidArgument(f"{_at(where)}{r.field} must be {r.min}-{r.max}")
    sub = agent.subagent_config
    for field in ("allowed_preset_agent_ids", "allowed_tool_names"):
        if sub.HasField(field):
            _names(getattr(sub, field), f"{_at(where)}subagentConfig.{_camel(field)}")
    if agent.HasField("remote"):
        if not REMOTE_URL.fullmatch(agent.remote.card_url):
            raise InvalidArgument(f"{_at(where)}remote.cardUrl must be an http(s) URL")
        if agent.remote.credential_env and not ENV_NAME.fullmatch(agent.remote.credential_env):
            raise InvalidArgument(f"{_at(where)}remote.credentialEnv must name an environment variable")
        if agent.public:
            raise InvalidArgument(f"{_at(where)}a remote agent cannot be public")


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
    """Agent override > global default (mesh config) > system fallback
    (docs/requirements.md#subagent-config-priority)."""
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


# ---- a user's writes ---------------------------------------------------------------------------------


def normalized(agent: ap.Agent, where: str = "") -> ap.Agent:
    """The agent as it is stored: output-only fields dropped, unset `limits` / `invoke` and an empty
    prompt or model given their defaults, validated (InvalidArgument naming the field)."""
    out = ap.Agent()
    out.CopyFrom(agent)
    for name, defaults in (("limits", DEFAULT_LIMITS), ("invoke", DEFAULT_INVOKE)):
        if not out.HasField(name):
            getattr(out, name).CopyFrom(defaults)
    if out.HasField("subagent_config") and not out.subagent_config.ByteSize():
        out.ClearField("subagent_config")  # nothing of its own: the same as no subagent config
    return from_json(to_json(out), where)


def merged(base: ap.Agent, given: ap.Agent, paths: Sequence[str], *, new: bool = False) -> ap.Agent:
    """`base` with the fields of `paths` taken from `given` (a path whose field `given` leaves unset
    resets it), normalized. Output-only paths are ignored; `slug` changes only when `new`."""
    paths = [p for p in paths if p.split(".")[0] not in OUTPUT_ONLY]
    for path in paths:
        if not field_mask_pb2.FieldMask(paths=[path]).IsValidForDescriptor(ap.Agent.DESCRIPTOR):
            raise InvalidArgument(f"unknown field {path!r}")
    if not new and "slug" in paths and given.slug != base.slug:
        raise InvalidArgument("slug cannot change: clone the agent to a new slug instead")
    out = ap.Agent()
    out.CopyFrom(base)
    field_mask_pb2.FieldMask(paths=paths).MergeMessage(
        given, out, replace_message_field=True, replace_repeated_field=True
    )
    return normalized(out)


def check_references(
    agent: ap.Agent, known: Collection[str], tools: ToolCatalog, blocked: Collection[str]
) -> None:
    """What a user's agent names exists: its tools in the mesh's tool catalog, its agent-invoke callees
    and subagent presets among the agents the user may use (`known`, or the agent itself); the tools it
    allows its subagents run in subagents and are not blocked for them. InvalidArgument otherwise."""
    agents = {*known, agent.slug}
    if agent.HasField("remote"):
        raise InvalidArgument("remote: only the mesh's catalog lists remote agents")
    for tool in agent.tools:
        if tool not in tools.specs:
            raise InvalidArgument(f"tools: unknown tool {tool!r} (the tools are {', '.join(tools.specs)})")
    for callee in agent.invoke.allowed_callees:
        if callee.startswith("@"):  # a peer's agent, @alias/slug (the alias is checked when it is called)
            alias, _, slug = callee[1:].partition("/")
            if not alias or not SLUG.fullmatch(slug):
                raise InvalidArgument(f"invoke.allowedCallees: a peer's agent is @alias/slug, not {callee!r}")
        elif callee != ANY_CALLEE and callee not in agents:
            raise InvalidArgument(f"invoke.allowedCallees: unknown agent {callee!r}")
    sub = agent.subagent_config
    for preset in names(sub, "allowed_preset_agent_ids") or ():
        if preset not in agents:
            raise InvalidArgument(f"subagentConfig.allowedPresetAgentIds: unknown agent {preset!r}")
    for tool in names(sub, "allowed_tool_names") or ():
        where = f"subagentConfig.allowedToolNames: {tool!r}"
        if tool in blocked:
            raise InvalidArgument(f"{where} is blocked for every subagent by the mesh")
        if tool not in tools.specs:
            raise InvalidArgument(f"{where} is not a tool (the tools are {', '.join(tools.specs)})")
        if tool not in tools.choosable(SUBAGENT, blocked):
            raise InvalidArgument(f"{where} does not run in subagents")


def free_slug(base: str, taken: Collection[str]) -> str:
    """The first of `<base>-copy`, `<base>-copy-2`, ... that is not taken (and fits a slug)."""
    stem = f"{base[:94]}-copy"
    slug, n = stem, 1
    while slug in taken:
        n += 1
        slug = f"{stem}-{n}"
    return slug
