"""The built-in tools and the roles that have a handler for each (the instantiation layer)."""

from __future__ import annotations

from typing import Any

from services.agent_runtime.tools import SUPERVISOR, ToolContext, ToolOutcome, ToolRegistry, ToolSpec

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
        return ToolOutcome({"ok": False, "error": "question is required"}, ok=False)
    return ToolOutcome({"ok": True, "question": question}, stop_run=True)


def register_all(registry: ToolRegistry) -> None:
    registry.register(CLARIFY, clarify, roles=(SUPERVISOR,))
