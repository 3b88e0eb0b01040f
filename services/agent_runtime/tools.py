"""The tool registry, in two separate layers (docs/requirements.md#tool-layers):

- visibility: which tool schemas the model of a run is shown (catalog tools, role, subagent
  config, the run's own allow-list, the global blocked list for subagents);
- instantiation: which handlers exist for a run role.

The tools themselves (names, schemas, the roles that have a handler) and the visibility rule are the
shared vocabulary of libs/tools.py, which the trace service reads too to validate agents and offer
their choices; this module binds the handlers. `resolve` shows a tool only when both layers agree, so
a visible tool always has a handler and a tool without a handler is never shown.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import MeshError
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.tools import (  # the shared tool vocabulary (libs/tools.py)
    A2A_CALLEE,
    BUILTIN,
    DELEGATE_TOOLS,
    ROLES,
    SUBAGENT,
    SUPERVISOR,
    ToolCatalog,
    ToolSpec,
    names,
)
from agentmesh.services.agent_runtime.directory import AgentDirectory
from agentmesh.services.agent_runtime.sink import EventSink

__all__ = [
    "A2A_CALLEE",
    "DELEGATE_TOOLS",
    "ROLES",
    "SUBAGENT",
    "SUPERVISOR",
    "Handler",
    "RunState",
    "ToolContext",
    "ToolOutcome",
    "ToolRegistry",
    "ToolSpec",
    "names",
]


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
    # Background children whose end this run's model learned (the note, a tool), and the note it got
    # (docs/agents.md#background-subagents): kept on the reply, so that no later turn is told again.
    background_seen: set[str] = field(default_factory=set)
    background_note: str = ""


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


class ToolRegistry:
    """The tools of this runtime: the shared catalog's specs and visibility rule (libs/tools.py), and the
    handlers bound to them, each present in the roles its spec names (the instantiation layer)."""

    def __init__(self, catalog: ToolCatalog = BUILTIN) -> None:
        self.catalog = catalog
        self.specs = catalog.specs
        self._handlers: dict[str, Handler] = {}

    def bind(self, name: str, handler: Handler) -> None:
        """Instantiation layer: `handler` runs the tool `name` in the roles of its spec."""
        if name not in self.specs:
            raise ValueError(f"no tool {name!r} in the catalog")
        self._handlers[name] = handler

    def check(self) -> None:
        """Every tool of the catalog has a handler (a runtime that lacks one must not start)."""
        missing = sorted(set(self.specs) - set(self._handlers))
        if missing:
            raise RuntimeError(f"tools without a handler: {', '.join(missing)}")

    def handlers(self, role: int) -> dict[str, Handler]:
        return {n: self._handlers[n] for n in self.catalog.instantiated(role) if n in self._handlers}

    def visible(self, agent: ap.Agent, role: int, allow: list[str] | None = None) -> list[str]:
        """Visibility layer: the names whose schemas this run's model may see."""
        return self.catalog.visible(agent, role, allow)

    def resolve(self, agent: ap.Agent, role: int, allow: list[str] | None = None) -> dict[str, Handler]:
        """The tools a run gets: visible AND instantiated for its role."""
        handlers = self.handlers(role)
        return {name: handlers[name] for name in self.visible(agent, role, allow) if name in handlers}

    def schemas(self, names: list[str]) -> list[dict[str, Any]]:
        return [self.specs[n].schema() for n in names]
