"""The tool vocabulary: every built-in tool's name, the schema its model is shown, and the run roles
that have a handler for it, plus the visibility rule of
docs/requirements.md#tool-layers (which of an agent's tools
a run's model may see).

Two processes read this table: the agent-runtime binds one handler to each tool
(services/agent_runtime/builtin_tools.py; it refuses to start when a tool lacks one) and resolves a
run's tools with it, and the trace service validates agents and offers their choices from it
(AgentService.GetAgentOptions). One table in the image both run from, rather than an RPC from the
trace service to the runtime: writing an agent and listing its options keep working while runtimes
restart, and the database layer never calls up into the layer that calls it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.runtime.v1 import runtime_service_pb2 as rt

SUPERVISOR = rt.RUN_ROLE_SUPERVISOR
SUBAGENT = rt.RUN_ROLE_SUBAGENT
A2A_CALLEE = rt.RUN_ROLE_A2A_CALLEE
ROLES = (SUPERVISOR, SUBAGENT, A2A_CALLEE)
DELEGATE_TOOLS = ("delegate_task", "delegate_parallel")
# The handles of background children (docs/agents.md#background-subagents): shown to a supervisor
# with the delegate tools, whether or not its agent lists them.
BACKGROUND_TOOLS = ("subagent_status", "subagent_wait", "subagent_stop")
# Never shown to an agent-invoke callee, whatever its agent lists: it cannot delegate or ask the user.
CALLEE_HIDDEN = (*DELEGATE_TOOLS, *BACKGROUND_TOOLS, "clarify")
# The public role of agentmesh.agents.v1 (AgentService) for each run role.
AGENT_ROLE = {
    SUPERVISOR: ap.AGENT_ROLE_SUPERVISOR,
    SUBAGENT: ap.AGENT_ROLE_SUBAGENT,
    A2A_CALLEE: ap.AGENT_ROLE_A2A_CALLEE,
}


@dataclass(frozen=True)
class ToolSpec:
    """A tool: what the model is shown, and the run roles that have a handler for it."""

    name: str
    description: str
    parameters: dict[str, Any]
    roles: tuple[int, ...]

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def names(config: Any, field: str) -> list[str] | None:
    """A name list of a subagent config (a ListValue whose presence matters) as a list; None when absent."""
    return [v.string_value for v in getattr(config, field).values] if config.HasField(field) else None


class ToolCatalog:
    """The tools of a mesh by name, with the visibility layer of the two-layer registry."""

    def __init__(self, specs: Iterable[ToolSpec]) -> None:
        self.specs: dict[str, ToolSpec] = {}
        for spec in specs:
            if spec.name in self.specs:
                raise ValueError(f"tool {spec.name!r} is declared twice")
            self.specs[spec.name] = spec

    def instantiated(self, role: int) -> list[str]:
        """The tools with a handler in runs of this role."""
        return [name for name, spec in self.specs.items() if role in spec.roles]

    def visible(self, agent: ap.Agent, role: int, allow: list[str] | None = None) -> list[str]:
        """Visibility layer: the names whose schemas this run's model may see."""
        visible = [n for n in agent.tools if n in self.specs]
        cfg = agent.effective_subagent_config
        if role == SUPERVISOR:
            if not cfg.enabled:
                visible = [n for n in visible if n not in (*DELEGATE_TOOLS, *BACKGROUND_TOOLS)]
            elif any(n in DELEGATE_TOOLS for n in visible):
                visible += [n for n in BACKGROUND_TOOLS if n in self.specs and n not in visible]
        elif role == SUBAGENT:
            visible = [n for n in visible if n not in cfg.blocked_tool_names]
        elif role == A2A_CALLEE:
            visible = [n for n in visible if n not in CALLEE_HIDDEN]
        if allow is not None:
            visible = [n for n in visible if n in allow]
        return visible

    def choosable(self, role: int, blocked: Iterable[str] = ()) -> list[str]:
        """The tools an agent's settings can give a run of this role: a handler exists and no rule of
        the role hides it (`blocked`: the mesh's tools no subagent gets)."""
        hidden = set(blocked) if role == SUBAGENT else set(CALLEE_HIDDEN) if role == A2A_CALLEE else set()
        hidden |= set(BACKGROUND_TOOLS)  # never chosen: they come with the delegate tools
        return [n for n in self.instantiated(role) if n not in hidden]


_TASK_PROPS: dict[str, Any] = {
    "goal": {"type": "string", "description": "What the subagent must achieve."},
    "context": {"type": "string", "description": "Facts the subagent needs."},
    "agentSlug": {"type": "string", "description": "A preset agent to run (mode preset)."},
    "agentId": {"type": "string", "description": "Same as agentSlug."},
    "mode": {"type": "string", "enum": ["preset", "clone"], "description": "preset agent or a clone of you."},
    "toolNames": {"type": "array", "items": {"type": "string"}, "description": "Tools the subagent may use."},
    "maxToolRounds": {"type": "integer", "minimum": 0, "maximum": 20},
}
_BACKGROUND: dict[str, Any] = {
    "type": "boolean",
    "description": (
        "Run in the background: return at once with a handle per subagent (its id and traceId); follow "
        "them with subagent_status, subagent_wait and subagent_stop. You are told when one ends."
    ),
}
_HANDLE: dict[str, Any] = {
    "type": "string",
    "description": "A background subagent's id (from its handle); omitted: every one of this chat.",
}
MAX_DELEGATE_TASKS = 10

AGENT_INVOKE = ToolSpec(
    name="agent-invoke",
    description=(
        "Ask another agent (by `agentSlug`, or a remote A2A agent by `agentUrl`) to do a task and get its "
        "answer. `input` may be a list of tasks for the same agent, run in parallel. `continueFrom` "
        "continues the conversation of an earlier call (its traceId)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "agentSlug": {"type": "string", "description": "The agent to call."},
            "agentUrl": {
                "type": "string",
                "description": "Or: the agent card URL of a remote A2A agent the catalog lists.",
            },
            "input": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
                "description": "The task, or several tasks run in parallel.",
            },
            "continueFrom": {"type": "string", "description": "traceId of an earlier call to continue."},
        },
        "required": ["input"],
    },
    roles=(SUPERVISOR, SUBAGENT, A2A_CALLEE),
)
DELEGATE_TASK = ToolSpec(
    name="delegate_task",
    description="Delegate one self-contained goal to a subagent and get its summary back.",
    parameters={
        "type": "object",
        "properties": {**_TASK_PROPS, "background": _BACKGROUND},
        "required": ["goal"],
    },
    roles=(SUPERVISOR,),
)
DELEGATE_PARALLEL = ToolSpec(
    name="delegate_parallel",
    description="Delegate independent goals to subagents that run in parallel; get every result back.",
    parameters={
        "type": "object",
        "properties": {
            "tasks": {
                "type": "array",
                "minItems": 1,
                "maxItems": MAX_DELEGATE_TASKS,
                "items": {"type": "object", "properties": _TASK_PROPS, "required": ["goal"]},
            },
            "background": _BACKGROUND,
        },
        "required": ["tasks"],
    },
    roles=(SUPERVISOR,),
)
CLARIFY = ToolSpec(
    name="clarify",
    description="Ask the user a clarifying question and stop until they answer.",
    parameters={
        "type": "object",
        "properties": {"question": {"type": "string", "description": "The question for the user."}},
        "required": ["question"],
    },
    roles=(SUPERVISOR,),
)

SUBAGENT_STATUS = ToolSpec(
    name="subagent_status",
    description="How background subagents are doing: each one's status and its latest summary.",
    parameters={"type": "object", "properties": {"id": _HANDLE}},
    roles=(SUPERVISOR,),
)
SUBAGENT_WAIT = ToolSpec(
    name="subagent_wait",
    description="Wait until a background subagent (or every one) has ended, at most timeoutMs.",
    parameters={
        "type": "object",
        "properties": {
            "id": _HANDLE,
            "timeoutMs": {
                "type": "integer",
                "minimum": 0,
                "maximum": 600_000,
                "description": "default 30000",
            },
        },
    },
    roles=(SUPERVISOR,),
)
SUBAGENT_STOP = ToolSpec(
    name="subagent_stop",
    description="Stop a background subagent (or every one still running); it ends cancelled.",
    parameters={"type": "object", "properties": {"id": _HANDLE}},
    roles=(SUPERVISOR,),
)

BUILTIN = ToolCatalog(
    [AGENT_INVOKE, DELEGATE_TASK, DELEGATE_PARALLEL, CLARIFY, SUBAGENT_STATUS, SUBAGENT_WAIT, SUBAGENT_STOP]
)
