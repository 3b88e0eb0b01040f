"""The handlers of the built-in tools (the instantiation layer); the tools and the roles each runs in
are declared in libs/tools.py."""

from __future__ import annotations

from typing import Any

from agentmesh.libs import tools
from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.agent_runtime import background, invoke, subagents
from agentmesh.services.agent_runtime.tools import ToolContext, ToolOutcome, ToolRegistry


async def clarify(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    question = str(args.get("question", "")).strip()
    if not question:
        return ToolOutcome.failed(InvalidArgument("question is required"))
    return ToolOutcome({"ok": True, "question": question}, stop_run=True)


def register_all(registry: ToolRegistry) -> None:
    """Binds a handler to every tool of libs/tools.py; each runs in the roles its spec names."""
    registry.bind(tools.AGENT_INVOKE.name, invoke.agent_invoke)
    registry.bind(tools.DELEGATE_TASK.name, subagents.delegate_task)
    registry.bind(tools.DELEGATE_PARALLEL.name, subagents.delegate_parallel)
    registry.bind(tools.CLARIFY.name, clarify)
    registry.bind(tools.SUBAGENT_STATUS.name, background.subagent_status)
    registry.bind(tools.SUBAGENT_WAIT.name, background.subagent_wait)
    registry.bind(tools.SUBAGENT_STOP.name, background.subagent_stop)
    registry.check()
