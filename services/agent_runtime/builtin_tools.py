"""The built-in tools and the roles that have a handler for each (the instantiation layer)."""

from __future__ import annotations

from typing import Any

from libs.errors import InvalidArgument
from services.agent_runtime import invoke, subagents
from services.agent_runtime.tools import (
    A2A_CALLEE,
    SUBAGENT,
    SUPERVISOR,
    ToolContext,
    ToolOutcome,
    ToolRegistry,
    ToolSpec,
)

CLARIFY = ToolSpec(
    name="clarify",
    description="Ask the user a clarifying question and stop until they answer.",
    parameters={
        "type": "object",
        "properties": {"question": {"type": "string", "description": "The question for the user."}},
        "required": ["question"],
    },
)


async def clarify(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    question = str(args.get("question", "")).strip()
    if not question:
        return ToolOutcome.failed(InvalidArgument("question is required"))
    return ToolOutcome({"ok": True, "question": question}, stop_run=True)


def register_all(registry: ToolRegistry) -> None:
    registry.register(invoke.SPEC, invoke.agent_invoke, roles=(SUPERVISOR, SUBAGENT, A2A_CALLEE))
    registry.register(subagents.DELEGATE_TASK, subagents.delegate_task, roles=(SUPERVISOR,))
    registry.register(subagents.DELEGATE_PARALLEL, subagents.delegate_parallel, roles=(SUPERVISOR,))
    registry.register(CLARIFY, clarify, roles=(SUPERVISOR,))
