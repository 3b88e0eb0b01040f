"""The agent catalog: a YAML file of agents, loaded once at start by every service that needs it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from libs.config import SubagentDefaults
from libs.errors import InvalidArgument, NotFound


class _Model(BaseModel):
    """Accepts snake_case and camelCase keys in the YAML."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Limits(_Model):
    max_steps: int = 8
    max_output_tokens: int = 4096
    timeout_ms: int = 120_000


class InvokeConfig(_Model):
    """agent-invoke limits of a caller (seed 1 options)."""

    allowed_callees: list[str] = Field(default_factory=list)  # slugs; "*" allows all
    max_recursion_depth: int = 3
    timeout_ms: int = 60_000
    max_output_tokens: int = 2048
    max_parallel: int = 4


class SubagentConfig(_Model):
    """Per-agent subagent overrides (seed 3 section 6); None means "use the global default"."""

    enabled: bool | None = None
    max_concurrent: int | None = None
    allowed_preset_agent_ids: list[str] | None = None  # slugs of preset agents
    allowed_tool_names: list[str] | None = None
    timeout_ms: int | None = None


class Agent(_Model):
    slug: str
    name: str
    description: str = ""
    system_prompt: str = "You are a helpful assistant."
    model: str = "mock-gpt"
    tools: list[str] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    invoke: InvokeConfig = Field(default_factory=InvokeConfig)
    subagent_config: SubagentConfig = Field(default_factory=SubagentConfig)


class Catalog(_Model):
    agents: list[Agent]

    def get(self, slug: str) -> Agent:
        for agent in self.agents:
            if agent.slug == slug:
                return agent
        raise NotFound(f"unknown agent {slug!r}")

    def has(self, slug: str) -> bool:
        return any(a.slug == slug for a in self.agents)


def load_catalog(path: Path | str) -> Catalog:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        catalog = Catalog.model_validate(data)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise InvalidArgument(f"bad agent catalog {path}: {exc}") from exc
    slugs = [a.slug for a in catalog.agents]
    if len(slugs) != len(set(slugs)):
        raise InvalidArgument(f"bad agent catalog {path}: duplicate slugs")
    return catalog


@dataclass
class EffectiveSubagentConfig:
    enabled: bool
    max_concurrent: int
    allowed_preset_agent_ids: list[str] | None
    allowed_tool_names: list[str] | None
    blocked_tool_names: list[str]
    timeout_ms: int


SYSTEM_FALLBACK = SubagentConfig(
    enabled=False, max_concurrent=1, allowed_preset_agent_ids=None, allowed_tool_names=None, timeout_ms=60_000
)


def subagent_config(agent: Agent, defaults: SubagentDefaults | None) -> EffectiveSubagentConfig:
    """Agent override > global default (mesh config) > system fallback (seed 3 section 6.1)."""
    own = agent.subagent_config
    glob = defaults

    def pick(name: str) -> Any:
        value = getattr(own, name)
        if value is not None:
            return value
        if glob is not None and hasattr(glob, name):
            return getattr(glob, name)
        return getattr(SYSTEM_FALLBACK, name)

    return EffectiveSubagentConfig(
        enabled=bool(pick("enabled")),
        max_concurrent=max(1, int(pick("max_concurrent"))),
        allowed_preset_agent_ids=own.allowed_preset_agent_ids,
        allowed_tool_names=own.allowed_tool_names,
        blocked_tool_names=list(glob.blocked_tool_names if glob else SubagentDefaults().blocked_tool_names),
        timeout_ms=int(pick("timeout_ms")),
    )
