"""Session subagents (seed 3): delegate_task / delegate_parallel for the supervisor role only.

Each subagent gets a subagent_sessions row anchored to the turn's assistant placeholder
(`parentMessageId`), its own hidden session, and its live text on subagent:<id>. At most
`maxConcurrent` run at once; the rest wait `queued`. A failure or timeout touches only its own
subagent; the supervisor's model receives every result or error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from google.protobuf import field_mask_pb2

from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import trace_pb2 as tp
from agentmesh.v1 import trace_service_pb2 as ts
from libs import events
from libs.catalog import Agent, subagent_config
from libs.errors import MeshError, call
from libs.subagent_batches import build_batches, item_from_row, summarize
from libs.turns import TurnRunner, TurnSpec, error_code
from services.agent_runtime.tools import SUBAGENT, ToolContext, ToolOutcome, ToolSpec

_TASK_PROPS: dict[str, Any] = {
    "goal": {"type": "string", "description": "What the subagent must achieve."},
    "context": {"type": "string", "description": "Facts the subagent needs."},
    "agentSlug": {"type": "string", "description": "A preset agent to run (mode preset)."},
    "agentId": {"type": "string", "description": "Same as agentSlug."},
    "mode": {"type": "string", "enum": ["preset", "clone"], "description": "preset agent or a clone of you."},
    "toolNames": {"type": "array", "items": {"type": "string"}, "description": "Tools the subagent may use."},
    "maxToolRounds": {"type": "integer", "minimum": 0, "maximum": 20},
}
DELEGATE_TASK = ToolSpec(
    name="delegate_task",
    description="Delegate one self-contained goal to a subagent and get its summary back.",
    parameters={"type": "object", "properties": _TASK_PROPS, "required": ["goal"]},
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
                "maxItems": 10,
                "items": {"type": "object", "properties": _TASK_PROPS, "required": ["goal"]},
            }
        },
        "required": ["tasks"],
    },
)
MAX_TASKS = 10

GUIDANCE = """

## You are a subagent
You are a subagent inside a chat session, working for the parent agent "{parent}".
- Complete only this goal: {goal}
- Never ask the user anything: you cannot talk to the user, and clarify is not available to you.
- Never delegate: you cannot create other subagents.
- Your final answer goes to the parent agent, not to the user: answer with a concise summary of the result."""


@dataclass
class _Plan:
    """One subagent to start: what the call asked, resolved against the catalog and the config."""

    goal: str
    context: str
    source_type: str
    agent: Agent
    name: str
    tool_names: list[str] | None
    max_steps: int
    error: str = ""


def _plan(ctx: ToolContext, task: Any) -> _Plan:
    cfg = subagent_config(ctx.agent, ctx.settings.subagent)
    if not isinstance(task, dict):
        return _Plan("", "", "preset", ctx.agent, "subagent", None, 0, error="each task must be an object")
    goal = str(task.get("goal") or "").strip()
    context = str(task.get("context") or "")
    slug = str(task.get("agentSlug") or task.get("agentId") or "").strip()
    mode = str(task.get("mode") or ("preset" if slug else "clone"))
    rounds = task.get("maxToolRounds")
    max_steps = int(rounds) + 1 if isinstance(rounds, int) and rounds >= 0 else 0
    plan = _Plan(goal, context, mode, ctx.agent, f"{ctx.agent.name} (clone)", None, max_steps)
    if not goal:
        plan.error = "goal is required"
    elif mode not in ("preset", "clone"):
        plan.error = f"mode must be preset or clone, not {mode!r}"
    elif mode == "preset":
        if not slug or not ctx.catalog.has(slug):
            plan.error = f"unknown preset agent {slug!r}"
        elif cfg.allowed_preset_agent_ids is not None and slug not in cfg.allowed_preset_agent_ids:
            plan.error = f"preset agent {slug!r} is not allowed for {ctx.agent.slug!r}"
        else:
            plan.agent = ctx.catalog.get(slug)
            plan.name = plan.agent.name
    asked = task.get("toolNames")
    names = list(asked) if isinstance(asked, list) else None
    if cfg.allowed_tool_names is not None:
        names = [
            n for n in (names if names is not None else cfg.allowed_tool_names) if n in cfg.allowed_tool_names
        ]
    if names is not None:
        names = [n for n in names if n not in cfg.blocked_tool_names]
    plan.tool_names = names
    return plan


class SubagentBatch:
    """One delegate call: rows, events, concurrency, failure isolation, cancellation."""

    def __init__(self, ctx: ToolContext, plans: list[_Plan], title: str) -> None:
        self.ctx = ctx
        self.plans = plans
        self.title = title
        self.cfg = subagent_config(ctx.agent, ctx.settings.subagent)
        self.rows: list[tp.SubagentSession] = []
        self.outputs: list[dict[str, Any]] = []

    async def _update(self, i: int, paths: list[str], **values: Any) -> None:
        row = tp.SubagentSession(id=self.rows[i].id)
        for key, value in values.items():
            if isinstance(value, ev.Usage):
                getattr(row, key).CopyFrom(value)
            elif key == "result_payload":
                row.result_payload.CopyFrom(events.struct(value))
            else:
                setattr(row, key, value)
        resp = await call(
            self.ctx.clients.trace.UpdateSubagentSession(
                ts.UpdateSubagentSessionRequest(
                    owner=self.ctx.owner, subagent=row, update_mask=field_mask_pb2.FieldMask(paths=paths)
                )
            )
        )
        self.rows[i] = resp.subagent
        self._emit_update(i)

    def _emit_update(self, i: int) -> None:
        self.ctx.sink.emit(
            ev.Event(
                subagent_update=ev.SubagentUpdate(
                    parent_message_id=self.ctx.anchor_message_id, subagent=item_from_row(self.rows[i])
                )
            )
        )

    async def run(self) -> ToolOutcome:
        ctx = self.ctx
        started = time.monotonic()
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
        for i, plan in enumerate(self.plans):
            resp = await call(
                ctx.clients.trace.CreateSubagentSession(
                    ts.CreateSubagentSessionRequest(
                        owner=ctx.owner,
                        subagent=tp.SubagentSession(
                            session_id=ctx.session_id,
                            parent_message_id=ctx.anchor_message_id,
                            parent_tool_call_id=ctx.tool_call_id,
                            parent_agent=ctx.agent.slug,
                            source_type=plan.source_type,
                            preset_agent=plan.agent.slug
                            if plan.source_type == "preset" and not plan.error
                            else "",
                            name=plan.name,
                            goal=plan.goal,
                            context=plan.context,
                            model=plan.agent.model if plan.source_type == "preset" else ctx.agent.model,
                            tool_names=plan.tool_names or [],
                            sort_order=i,
                            batch_title=self.title,
                        ),
                    )
                )
            )
            self.rows.append(resp.subagent)
            self._emit_update(i)
        slots = asyncio.Semaphore(self.cfg.max_concurrent)
        tasks = [asyncio.create_task(self._one(i, slots)) for i in range(len(self.plans))]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
            raise
        finally:
            await asyncio.shield(self._record())
        summary = summarize(r.status for r in self.rows)
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
        counts = {"total": summary.total, "completed": summary.completed, "failed": summary.failed}
        ok = summary.completed > 0
        return ToolOutcome({"ok": ok, "results": self.outputs, "summary": counts}, ok=ok, metadata=meta)

    async def _record(self) -> None:
        """The anchor's metadata.subagents, rebuilt from the rows (the same builder restores it)."""
        ctx = self.ctx
        with contextlib.suppress(MeshError, asyncio.TimeoutError):
            async with asyncio.timeout(5):
                resp = await call(
                    ctx.clients.trace.ListSubagentSessions(
                        ts.ListSubagentSessionsRequest(
                            owner=ctx.owner,
                            session_id=ctx.session_id,
                            parent_message_id=ctx.anchor_message_id,
                        )
                    )
                )
                async with ctx.state.batch_lock:
                    ctx.state.subagent_batches[:] = build_batches(resp.subagents)

    async def _one(self, i: int, slots: asyncio.Semaphore) -> None:
        plan = self.plans[i]
        row = self.rows[i]
        out: dict[str, Any] = {"id": row.id, "name": plan.name, "goal": plan.goal}
        self.outputs.append(out)
        if plan.error:
            await self._update(
                i,
                ["status", "error"],
                status=ev.SUBAGENT_STATUS_FAILED,
                error=plan.error,
            )
            out.update(status="failed", error=plan.error)
            return
        try:
            async with slots:
                await self._update(i, ["status"], status=ev.SUBAGENT_STATUS_RUNNING)
                await self._execute(i, plan, out)
        except asyncio.CancelledError:
            out.update(status="cancelled", error="cancelled")
            with contextlib.suppress(MeshError):
                await asyncio.shield(
                    self._update(
                        i,
                        ["status", "error"],
                        status=ev.SUBAGENT_STATUS_CANCELLED,
                        error="cancelled",
                    )
                )
            raise

    async def _execute(self, i: int, plan: _Plan, out: dict[str, Any]) -> None:
        ctx = self.ctx
        row = self.rows[i]
        base = plan.agent.system_prompt
        prompt = base + GUIDANCE.format(parent=ctx.agent.name, goal=plan.goal)
        text = plan.goal if not plan.context else f"{plan.goal}\n\nContext:\n{plan.context}"
        spec = TurnSpec(
            owner=ctx.owner,
            session_id=row.child_session_id,
            agent=plan.agent.slug,
            user_text=text,
            stream_key=f"subagent:{row.id}",
            role=SUBAGENT,
            depth=ctx.depth,
            source=tp.MESSAGE_SOURCE_SUBAGENT,
            caller_agent=ctx.agent.slug,
            caller_session_id=ctx.session_id,
            system_prompt=prompt,
            tool_names=plan.tool_names,
            model=plan.agent.model if plan.source_type == "preset" else ctx.agent.model,
            max_steps=plan.max_steps,
            timeout_ms=min(self.cfg.timeout_ms, plan.agent.limits.timeout_ms),  # its own, only its own
            stream_metadata={
                "agent": plan.agent.slug,
                "kind": "subagent",
                "parentMessageId": str(ctx.anchor_message_id),
            },
        )
        outcome = await TurnRunner(ctx.clients).run(spec)
        if outcome.ok:
            assert outcome.result is not None
            r = outcome.result
            await self._update(
                i,
                ["status", "summary", "result_payload", "token_usage", "model"],
                status=ev.SUBAGENT_STATUS_COMPLETED,
                summary=r.content,
                result_payload={"content": r.content, "finishReason": r.finish_reason},
                token_usage=r.usage,
                model=r.model,
            )
            out.update(status="completed", summary=r.content)
        else:
            err = outcome.error or MeshError("the subagent failed")
            code = error_code(err)
            status = ev.SUBAGENT_STATUS_CANCELLED if code == "cancelled" else ev.SUBAGENT_STATUS_FAILED
            message = f"{code}: {err.message}"
            await self._update(i, ["status", "error"], status=status, error=message)
            out.update(status="failed", error=message)


async def _delegate(ctx: ToolContext, tasks: list[Any], title: str) -> ToolOutcome:
    cfg = subagent_config(ctx.agent, ctx.settings.subagent)
    if not cfg.enabled:
        return ToolOutcome({"ok": False, "error": "subagents are disabled for this agent"}, ok=False)
    if not tasks or len(tasks) > MAX_TASKS:
        return ToolOutcome({"ok": False, "error": f"give between 1 and {MAX_TASKS} tasks"}, ok=False)
    return await SubagentBatch(ctx, [_plan(ctx, t) for t in tasks], title).run()


async def delegate_task(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    goal = str(args.get("goal") or "").strip()
    return await _delegate(ctx, [args], goal[:80] or "Subtask")


async def delegate_parallel(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    tasks = args.get("tasks")
    if not isinstance(tasks, list):
        return ToolOutcome({"ok": False, "error": "tasks must be a list"}, ok=False)
    return await _delegate(ctx, tasks, f"{len(tasks)} parallel subtasks")
