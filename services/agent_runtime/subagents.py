"""Session subagents (docs/requirements.md#session-subagents): delegate_task / delegate_parallel for
the supervisor role only.

The tool plans the batch (each task resolved against the agents and the subagent config: preset or
clone, its tools, its guidance) and fails fast, creating nothing, when a task cannot run as asked. The
orchestrator runs the batch (RunSubagents): each subagent a turn in a hidden trace of its own, a row
anchored to this turn's placeholder (`parentMessageId`), its live text on subagent:<id>, at most
`maxConcurrent` at once. The tool turns the rows it reports into the batch's events in this turn's
buffer; the supervisor's model receives every result or error. With `background: true` the same
batch runs on without the call: the tool returns at once with a handle per subagent (its id and its
trace), which background.py's tools follow (docs/agents.md#background-subagents).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import InvalidArgument, MeshError, from_rpc_error
from agentmesh.libs.protojson import to_json
from agentmesh.libs.tools import MAX_DELEGATE_TASKS
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.tools import ToolContext, ToolOutcome, names
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_TASKS = MAX_DELEGATE_TASKS

GUIDANCE = """

## You are a subagent
You are a subagent inside a chat session, working for the parent agent "{parent}".
- Complete only this goal: {goal}
- Never ask the user anything: you cannot talk to the user, and clarify is not available to you.
- Never delegate: you cannot create other subagents.
- Your final answer goes to the parent agent, not to the user: answer with a concise summary of the result."""


@dataclass
class _Plan:
    """One subagent to start: what the call asked, resolved against the agents and the config."""

    goal: str
    context: str
    source: int  # ev.SubagentSource
    agent: ap.Agent
    name: str
    tool_names: list[str] | None
    max_steps: int


async def _plan(ctx: ToolContext, task: Any) -> _Plan:
    """Resolves one task of a delegate call; InvalidArgument (naming the problem) when it cannot run."""
    cfg = ctx.agent.effective_subagent_config
    if not isinstance(task, dict):
        raise InvalidArgument("each task must be an object")
    goal = str(task.get("goal") or "").strip()
    context = str(task.get("context") or "")
    slug = str(task.get("agentSlug") or task.get("agentId") or "").strip()
    mode = str(task.get("mode") or ("preset" if slug else "clone"))
    rounds = task.get("maxToolRounds")
    max_steps = int(rounds) + 1 if isinstance(rounds, int) and rounds >= 0 else 0
    if not goal:
        raise InvalidArgument("goal is required")
    if mode == "clone":
        plan = _Plan(
            goal, context, ev.SUBAGENT_SOURCE_CLONE, ctx.agent, f"{ctx.agent.name} (clone)", None, max_steps
        )
    elif mode == "preset":
        allowed = names(cfg, "allowed_preset_agent_ids")
        agent = await ctx.agents.find(slug) if slug else None
        if agent is None:
            raise InvalidArgument(f"unknown preset agent {slug!r}")
        if allowed is not None and slug not in allowed:
            raise InvalidArgument(f"preset agent {slug!r} is not allowed for {ctx.agent.slug!r}")
        plan = _Plan(goal, context, ev.SUBAGENT_SOURCE_PRESET, agent, agent.name, None, max_steps)
    else:
        raise InvalidArgument(f"mode must be preset or clone, not {mode!r}")
    asked = task.get("toolNames")
    tools = [str(n) for n in asked] if isinstance(asked, list) else None
    allowed_tools = names(cfg, "allowed_tool_names")
    if allowed_tools is not None:
        tools = [n for n in (tools if tools is not None else allowed_tools) if n in allowed_tools]
    if tools is not None:
        tools = [n for n in tools if n not in cfg.blocked_tool_names]
    plan.tool_names = tools
    return plan


class SubagentBatch:
    """One delegate call, as the supervisor's readers see it: the batch's events in the supervisor's
    buffer, from the rows the orchestrator reports while it runs the subagents."""

    def __init__(self, ctx: ToolContext, plans: list[_Plan], title: str, background: bool = False) -> None:
        self.ctx = ctx
        self.plans = plans
        self.title = title
        self.background = background
        self.cfg = ctx.agent.effective_subagent_config
        self.rows: list[tp.SubagentSession] = []

    def _emit_update(self, row: tp.SubagentSession) -> None:
        self.ctx.sink.emit(
            ev.Event(
                subagent_update=ev.SubagentUpdate(
                    parent_message_id=self.ctx.anchor_message_id, subagent=events.item_from_row(row)
                )
            )
        )

    def _request(self) -> orc.RunSubagentsRequest:
        ctx = self.ctx
        tasks = []
        timeout_ms = ctx.settings.subagent.background_timeout_ms if self.background else self.cfg.timeout_ms
        for plan in self.plans:
            prompt = plan.agent.system_prompt + GUIDANCE.format(parent=ctx.agent.name, goal=plan.goal)
            overrides = rt.RunOverrides(
                system_prompt=prompt, model=plan.agent.model, max_steps=plan.max_steps
            )
            if plan.tool_names is not None:
                overrides.tool_names.names.extend(plan.tool_names)
            tasks.append(
                orc.SubagentTask(
                    agent=plan.agent.slug,
                    source=plan.source,  # type: ignore[arg-type]
                    name=plan.name,
                    goal=plan.goal,
                    context=plan.context,
                    overrides=overrides,
                    limits=orc.TurnLimits(timeout_ms=timeout_ms),  # its own, only its own
                )
            )
        return orc.RunSubagentsRequest(
            trace_id=ctx.trace_id,
            anchor_message_id=ctx.anchor_message_id,
            tool_call_id=ctx.tool_call_id,
            parent_agent=ctx.agent.slug,
            title=self.title,
            tasks=tasks,
            max_concurrent=self.cfg.max_concurrent,
            depth=ctx.depth,
            background=self.background,
        )

    def _start_card(self) -> None:
        ctx = self.ctx
        ctx.sink.emit(
            ev.Event(
                subagent_batch_start=ev.SubagentBatchStart(
                    parent_message_id=ctx.anchor_message_id,
                    title=self.title,
                    total=len(self.plans),
                    tool_call_id=ctx.tool_call_id,
                )
            )
        )

    async def run(self) -> ToolOutcome:
        ctx = self.ctx
        started = time.monotonic()
        if not self.background:  # a background batch refused (too many running) shows no card
            self._start_card()
        ctx.state.subagent_batches[ctx.tool_call_id] = {}  # holds its place among the turn's batches
        call = ctx.clients.orchestrator.RunSubagents(self._request(), timeout=ctx.settings.turn_timeout_s)
        try:
            async for report in call:
                which = report.WhichOneof("payload")
                if which == "changed":
                    self.rows = [report.changed if r.id == report.changed.id else r for r in self.rows]
                    self._emit_update(report.changed)
                else:
                    self.rows = list(
                        report.created.subagents if which == "created" else report.ended.subagents
                    )
                    if which == "created":
                        if self.background:
                            self._start_card()
                        for row in self.rows:
                            self._emit_update(row)
        except grpc.aio.AioRpcError as exc:
            return ToolOutcome.failed(from_rpc_error(exc))
        finally:
            call.cancel()
            # The anchor's metadata.subagents: the same builder restores it from the rows.
            batch = events.build_batches(self.rows)
            ctx.state.subagent_batches[ctx.tool_call_id] = to_json(batch[0]) if batch else {}
        if self.background:  # the rows are the handles; the cards go on from the rows
            handles = [_handle(row) for row in self.rows]
            meta = {"subagentIds": [r.id for r in self.rows], "parentMessageId": ctx.anchor_message_id}
            return ToolOutcome({"ok": True, "background": True, "handles": handles}, metadata=meta)
        summary = events.summarize(r.status for r in self.rows)
        ctx.sink.emit(
            ev.Event(
                subagent_done=ev.SubagentDone(
                    parent_message_id=ctx.anchor_message_id, summary=summary, tool_call_id=ctx.tool_call_id
                )
            )
        )
        meta = {
            "durationMs": int((time.monotonic() - started) * 1000),
            "subagentIds": [r.id for r in self.rows],
            "parentMessageId": ctx.anchor_message_id,
        }
        counts = {
            "total": summary.total,
            "completed": summary.completed,
            "failed": summary.failed,
            "cancelled": summary.cancelled,
        }
        ok = summary.completed > 0
        outputs = [_output(row) for row in self.rows]
        return ToolOutcome({"ok": ok, "results": outputs, "summary": counts}, ok=ok, metadata=meta)


def _handle(row: tp.SubagentSession) -> dict[str, Any]:
    """What the supervisor's model keeps of a background subagent: the handle its tools take."""
    return {"id": row.id, "traceId": row.child_trace_id, "name": row.name, "goal": row.goal}


def _output(row: tp.SubagentSession) -> dict[str, Any]:
    """What the supervisor's model reads of one subagent."""
    out: dict[str, Any] = {"id": row.id, "name": row.name, "goal": row.goal}
    if row.status == ev.SUBAGENT_STATUS_COMPLETED:
        out.update(status="completed", summary=row.summary)
    else:
        cancelled = row.status == ev.SUBAGENT_STATUS_CANCELLED
        out.update(status="cancelled" if cancelled else "failed", error=row.error)
    return out


async def _delegate(ctx: ToolContext, tasks: list[Any], title: str, background: Any = False) -> ToolOutcome:
    if not ctx.agent.effective_subagent_config.enabled:
        return ToolOutcome.failed(InvalidArgument("subagents are disabled for this agent"))
    if not tasks or len(tasks) > MAX_TASKS:
        return ToolOutcome.failed(InvalidArgument(f"give between 1 and {MAX_TASKS} tasks"))
    plans, problems = [], []
    for i, task in enumerate(tasks):
        try:
            plans.append(await _plan(ctx, task))
        except MeshError as err:
            problems.append(f"task {i + 1}: {err.message}" if len(tasks) > 1 else err.message)
    if problems:  # fail fast: nothing is created for a batch that cannot run as asked
        return ToolOutcome.failed(InvalidArgument("; ".join(problems)))
    if not isinstance(background, bool):
        return ToolOutcome.failed(InvalidArgument("background must be true or false"))
    return await SubagentBatch(ctx, plans, title, background).run()


async def delegate_task(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    goal = str(args.get("goal") or "").strip()
    return await _delegate(ctx, [args], goal[:80] or "Subtask", args.get("background", False))


async def delegate_parallel(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    tasks = args.get("tasks")
    if not isinstance(tasks, list):
        return ToolOutcome.failed(InvalidArgument("tasks must be a list"))
    return await _delegate(ctx, tasks, f"{len(tasks)} parallel subtasks", args.get("background", False))
