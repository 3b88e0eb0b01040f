"""The tool registry, in two separate layers (seed 3 section 3.2):

- visibility: which tool schemas the model of a run is shown (catalog tools, role, subagent
  config, the run's own allow-list, the global blocked list for subagents);
- instantiation: which handlers exist for a run role.

`resolve` shows a tool only when both layers agree, so a visible tool always has a handler and a
tool without a handler is never shown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from libs.clients import Clients
from libs.config import MeshSettings
from libs.errors import MeshError
from libs.leases import LeaseKeeper
from services.agent_runtime.directory import AgentDirectory
from services.agent_runtime.sink import EventSink

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

    @classmethod
    def failed(cls, err: MeshError, metadata: dict[str, Any] | None = None) -> ToolOutcome:
        """A failed call: the model reads `{ok: false, error, code}` (code from the error table)."""
        return cls(
            {"ok": False, "error": err.message, "code": err.code_name}, ok=False, metadata=metadata or {}
        )


@dataclass
class RunState:
    """What the tools of one run collect for the anchor's metadata."""

    subagent_batches: dict[str, dict[str, Any]] = field(default_factory=dict)  # by delegate call, in order


def names(config: Any, field: str) -> list[str] | None:
    """A name list of a subagent config (a ListValue whose presence matters) as a list; None when absent."""
    return [v.string_value for v in getattr(config, field).values] if config.HasField(field) else None


@dataclass
class ToolContext:
    """What a tool handler knows of the run that called it. The acting user is the call's identity."""

    agent: ap.Agent
    role: int
    trace_id: str
    anchor_message_id: int
    depth: int
    tool_call_id: str
    sink: EventSink
    clients: Clients
    settings: MeshSettings
    agents: AgentDirectory
    state: RunState
    leases: LeaseKeeper


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
    def __init__(self) -> None:
        self.specs: dict[str, ToolSpec] = {}
        self._handlers: dict[int, dict[str, Handler]] = {role: {} for role in ROLES}

    def register(self, spec: ToolSpec, handler: Handler, roles: tuple[int, ...]) -> None:
        """Instantiation layer: `handler` exists for these run roles only."""
        self.specs[spec.name] = spec
        for role in roles:
            self._handlers[role][spec.name] = handler

    def handlers(self, role: int) -> dict[str, Handler]:
        return dict(self._handlers[role])

    def visible(self, agent: ap.Agent, role: int, allow: list[str] | None = None) -> list[str]:
        """Visibility layer: the names whose schemas this run's model may see."""
        visible = [n for n in agent.tools if n in self.specs]
        cfg = agent.effective_subagent_config
        if role == SUPERVISOR:
            if not cfg.enabled:
                visible = [n for n in visible if n not in DELEGATE_TOOLS]
        elif role == SUBAGENT:
            visible = [n for n in visible if n not in cfg.blocked_tool_names]
        elif role == A2A_CALLEE:
            visible = [n for n in visible if n not in (*DELEGATE_TOOLS, "clarify")]
        if allow is not None:
            visible = [n for n in visible if n in allow]
        return visible

    def resolve(self, agent: ap.Agent, role: int, allow: list[str] | None = None) -> dict[str, Handler]:
        """The tools a run gets: visible AND instantiated for its role."""
        handlers = self._handlers[role]
        return {name: handlers[name] for name in self.visible(agent, role, allow) if name in handlers}

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        return [self.specs[n].schema() for n in names]
