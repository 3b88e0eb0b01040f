"""agent-invoke: live, persisted, cancellable agent-to-agent calls (seed 1 section 2.1; seed 2's
`agent` tool: a list of inputs run in parallel, continue_from a trace).

A callee is anything with `Callee.run`; `LocalCallee` runs an agent of this mesh as a child turn
over gRPC. A remote mesh or A2A agent is one more implementation of the same interface.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import trace_pb2 as tp
from agentmesh.v1 import trace_service_pb2 as ts
from libs import events
from libs.errors import InvalidArgument, MeshError, NotFound, call
from libs.turns import TurnRunner, TurnSpec, error_code
from services.agent_runtime.tools import A2A_CALLEE, ToolContext, ToolOutcome, ToolSpec

log = logging.getLogger(__name__)

SPEC = ToolSpec(
    name="agent-invoke",
    description=(
        "Ask another agent to do a task and get its answer. `input` may be a list of tasks for the same "
        "agent, run in parallel. `continueFrom` continues the conversation of an earlier call (its traceId)."
    ),
    parameters={
        "type": "object",
        "properties": {
            "agentSlug": {"type": "string", "description": "The agent to call."},
            "input": {
                "anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}],
                "description": "The task, or several tasks run in parallel.",
            },
            "continueFrom": {"type": "string", "description": "traceId of an earlier call to continue."},
        },
        "required": ["agentSlug", "input"],
    },
)


@dataclass
class InvokeResult:
    output: str
    ok: bool
    task_id: str
    trace_id: str
    error: str = ""
    code: str = ""

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output": self.output,
            "ok": self.ok,
            "taskId": self.task_id,
            "traceId": self.trace_id,
        }
        if not self.ok:
            out["error"] = self.error
            out["code"] = self.code
        return out


class Callee(Protocol):
    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> InvokeResult: ...


class LocalCallee:
    """An agent of this mesh, run as a child turn on agent-runtime with its own hidden a2a session."""

    def __init__(self, slug: str) -> None:
        self.slug = slug

    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> InvokeResult:
        callee = ctx.catalog.get(self.slug)
        cfg = ctx.agent.invoke
        caller_context = {
            "toolCallId": ctx.tool_call_id,
            "depth": depth,
            "anchorMessageId": ctx.anchor_message_id,
        }
        task = (
            await call(
                ctx.clients.trace.CreateA2ATask(
                    ts.CreateA2ATaskRequest(
                        owner=ctx.owner,
                        callee_agent=callee.slug,
                        caller_agent=ctx.agent.slug,
                        caller_session_id=ctx.session_id,
                        caller_context=events.struct(caller_context),
                        continue_session_id=continue_from,
                    )
                )
            )
        ).task
        try:
            # Stored in the caller's stream BEFORE the callee starts, so a panel can subscribe at once.
            await ctx.sink.store(
                ev.Event(
                    a2a_task_started=ev.A2ATaskStarted(
                        task_id=task.id,
                        callee_agent_slug=callee.slug,
                        callee_agent_name=callee.name,
                        tool_call_id=ctx.tool_call_id,
                    )
                )
            )
            await self._state(ctx, task.id, tp.TASK_STATE_WORKING)
            spec = TurnSpec(
                owner=ctx.owner,
                session_id=task.session_id,
                agent=callee.slug,
                user_text=text,
                stream_key=f"a2a:{task.id}",
                role=A2A_CALLEE,
                depth=depth,
                source=tp.MESSAGE_SOURCE_A2A,
                a2a_task_id=task.id,
                caller_agent=ctx.agent.slug,
                caller_session_id=ctx.session_id,
                model=callee.model,
                max_output_tokens=cfg.max_output_tokens,
                timeout_ms=min(cfg.timeout_ms, callee.limits.timeout_ms),
                stream_metadata={
                    "agent": callee.slug,
                    "model": callee.model,
                    "kind": "a2a",
                    "taskId": task.id,
                },
            )
            outcome = await TurnRunner(ctx.clients).run(spec)
        except asyncio.CancelledError:
            await asyncio.shield(self._state(ctx, task.id, tp.TASK_STATE_CANCELED))
            raise
        except MeshError:
            await asyncio.shield(self._state(ctx, task.id, tp.TASK_STATE_FAILED))
            raise
        if outcome.ok:
            assert outcome.result is not None
            await self._state(ctx, task.id, tp.TASK_STATE_COMPLETED)
            return InvokeResult(outcome.result.content, True, task.id, task.session_id)
        err = outcome.error or MeshError("the callee failed")
        code = error_code(err)
        state = tp.TASK_STATE_CANCELED if code == "cancelled" else tp.TASK_STATE_FAILED
        await self._state(ctx, task.id, state)
        return InvokeResult("", False, task.id, task.session_id, error=err.message, code=code)

    @staticmethod
    async def _state(ctx: ToolContext, task_id: str, state: int) -> None:
        await call(
            ctx.clients.trace.UpdateA2ATask(
                ts.UpdateA2ATaskRequest(owner=ctx.owner, task_id=task_id, state=state)  # type: ignore[arg-type]
            )
        )


def resolve_callee(ctx: ToolContext, slug: str) -> Callee:
    """Checks the caller may call `slug`; raises before anything is created."""
    if not ctx.catalog.has(slug):
        raise NotFound(f"unknown agent {slug!r}")
    allowed = ctx.agent.invoke.allowed_callees
    if "*" not in allowed and slug not in allowed:
        raise InvalidArgument(f"agent {ctx.agent.slug!r} may not call {slug!r}")
    return LocalCallee(slug)


async def agent_invoke(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    started = time.monotonic()
    slug = str(args.get("agentSlug") or "").strip()
    raw = args.get("input")
    continue_from = str(args.get("continueFrom") or "")
    cfg = ctx.agent.invoke
    depth = ctx.depth + 1
    meta: dict[str, Any] = {"agentSlug": slug, "recursionDepth": depth}

    def fail(message: str, code: str) -> ToolOutcome:
        meta["durationMs"] = int((time.monotonic() - started) * 1000)
        return ToolOutcome({"ok": False, "error": message, "code": code}, ok=False, metadata=meta)

    if not slug:
        return fail("agentSlug is required", "invalid_argument")
    inputs = raw if isinstance(raw, list) else [raw]
    if not inputs or not all(isinstance(i, str) and i.strip() for i in inputs):
        return fail("input must be a non-empty string or a list of non-empty strings", "invalid_argument")
    if len(inputs) > cfg.max_parallel:
        return fail(f"at most {cfg.max_parallel} inputs may run in parallel", "invalid_argument")
    if continue_from and len(inputs) > 1:
        return fail("continueFrom takes a single input", "invalid_argument")
    if depth > cfg.max_recursion_depth:
        return fail(
            f"recursion depth {depth} exceeds the limit of {cfg.max_recursion_depth}", "depth_exceeded"
        )
    try:
        callee = resolve_callee(ctx, slug)
    except MeshError as err:
        return fail(err.message, err.reason.lower())

    async def one(text: str) -> InvokeResult:
        try:
            return await callee.run(ctx, text, continue_from, depth)
        except MeshError as err:  # e.g. continueFrom names no trace of this owner
            return InvokeResult("", False, "", "", error=err.message, code=err.reason.lower())

    results = await asyncio.gather(*(one(str(text)) for text in inputs))
    meta["durationMs"] = int((time.monotonic() - started) * 1000)
    if isinstance(raw, list):
        meta["taskIds"] = [r.task_id for r in results]
        ok = all(r.ok for r in results)
        return ToolOutcome({"ok": ok, "results": [r.as_json() for r in results]}, ok=ok, metadata=meta)
    result = results[0]
    meta["taskId"] = result.task_id
    meta["traceId"] = result.trace_id
    return ToolOutcome(result.as_json(), ok=result.ok, metadata=meta)
