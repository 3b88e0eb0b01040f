"""The tool registry, in two separate layers (seed 3 section 3.2):

- visibility: which tool schemas the model of a run is shown (catalog tools, role, subagent
  config, the run's own allow-list, the global blocked list for subagents);
- instantiation: which handlers exist for a run role.

`resolve` shows a tool only when both layers agree, so a visible tool always has a handler and a
tool without a handler is never shown.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentmesh.v1 import agent_runtime_service_pb2 as rt
from libs.catalog import Agent, Catalog, subagent_config
from libs.clients import Clients
from libs.config import MeshSettings
from libs.sink import EventSink

SUPERVISOR = rt.RUN_ROLE_SUPERVISOR
SUBAGENT = rt.RUN_ROLE_SUBAGENT
A2A_CALLEE = rt.RUN_ROLE_A2A_CALLEE
ROLES = (SUPERVISOR, SUBAGENT, A2A_CALLEE)
DELEGATE_TOOLS = ("delegate_task", "delegate_parallel")


@dataclass
class ToolOutcome:
    """What a handler returns: `output` goes back to the model, `metadata` onto the tool event."""

    output: Any
    ok: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)
    stop_run: bool = False


@dataclass
class RunState:
    """What the tools of one run collect for the anchor's metadata."""

    subagent_batches: list[dict[str, Any]] = field(default_factory=list)
    batch_lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass
class ToolContext:
    owner: str
    agent: Agent
    role: int
    session_id: str
    anchor_message_id: int
    depth: int
    tool_call_id: str
    sink: EventSink
    clients: Clients
    settings: MeshSettings
    catalog: Catalog
    state: RunState


Handler = Callable[[ToolContext, dict[str, Any]], Awaitable[ToolOutcome]]


@dataclass
class ToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


class ToolRegistry:
    def __init__(self, settings: MeshSettings) -> None:
        self.settings = settings
        self.specs: dict[str, ToolSpec] = {}
        self._handlers: dict[int, dict[str, Handler]] = {role: {} for role in ROLES}

    def register(self, spec: ToolSpec, handler: Handler, roles: tuple[int, ...]) -> None:
        """Instantiation layer: `handler` exists for these run roles only."""
        self.specs[spec.name] = spec
        for role in roles:
            self._handlers[role][spec.name] = handler

    def handlers(self, role: int) -> dict[str, Handler]:
        return dict(self._handlers[role])

    def visible(self, agent: Agent, role: int, allow: list[str] | None = None) -> list[str]:
        """Visibility layer: the names whose schemas this run's model may see."""
        names = [n for n in agent.tools if n in self.specs]
        cfg = subagent_config(agent, self.settings.subagent)
        if role == SUPERVISOR:
            if not cfg.enabled:
                names = [n for n in names if n not in DELEGATE_TOOLS]
        elif role == SUBAGENT:
            names = [n for n in names if n not in cfg.blocked_tool_names]
        elif role == A2A_CALLEE:
            names = [n for n in names if n not in (*DELEGATE_TOOLS, "clarify")]
        if allow is not None:
            names = [n for n in names if n in allow]
        return names

    def resolve(self, agent: Agent, role: int, allow: list[str] | None = None) -> dict[str, Handler]:
        """The tools a run gets: visible AND instantiated for its role."""
        handlers = self._handlers[role]
        return {name: handlers[name] for name in self.visible(agent, role, allow) if name in handlers}

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        return [self.specs[n].schema() for n in names]
