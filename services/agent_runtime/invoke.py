"""agent-invoke: live, persisted, cancellable agent-to-agent calls (seed 1 section 2.1; seed 2's
`agent` tool: a list of inputs run in parallel, continue_from a trace).

A callee is anything with `Callee.run`; `LocalCallee` runs an agent of this mesh as a child turn
through the orchestrator. A remote A2A agent is one more implementation of the same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from libs import events
from libs.aio import to_the_end
from libs.errors import (
    Cancelled,
    DepthExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    rpc,
)
from libs.identity import current_user
from libs.ids import TraceRef, a2a_key
from services.agent_runtime.children import close_buffer, create_buffer, run_child
from services.agent_runtime.peer_agents import PeerCallee, parse_remote_slug
from services.agent_runtime.tools import A2A_CALLEE, ToolContext, ToolOutcome

log = logging.getLogger(__name__)


@dataclass
class InvokeResult:
    output: str
    ok: bool
    task_id: str
    trace_id: str
    error: MeshError | None = None
    remote: bool = False  # the trace lives on a peer (trace_id is location-bearing)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output": self.output,
            "ok": self.ok,
            "taskId": self.task_id,
            "traceId": self.trace_id,
        }
        if self.remote or not TraceRef.parse(self.trace_id or "x").is_local:
            out["remote"] = True
        if self.error is not None:
            out["error"] = self.error.message
            out["code"] = self.error.code_name
        return out


class Callee(Protocol):
    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> InvokeResult: ...


class LocalCallee:
    """An agent of this mesh, run as a child turn with its own hidden a2a trace."""

    def __init__(self, agent: ap.Agent) -> None:
        self.agent = agent

    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> InvokeResult:
        callee = self.agent
        caller_context = {
            "toolCallId": ctx.tool_call_id,
            "depth": depth,
            "anchorMessageId": ctx.anchor_message_id,
        }
        task = (
            await rpc(
                ctx.clients.trace.CreateA2ATask(
                    ts.CreateA2ATaskRequest(
                        task=tp.A2ATask(
                            callee_agent=callee.slug,
                            caller_agent=ctx.agent.slug,
                            caller_session_id=ctx.trace_id,
                            caller_context=events.struct(caller_context),
                        ),
                        continue_trace_id=continue_from,
                    )
                )
            )
        ).task
        with ctx.leases.hold(task=task.id, stream=a2a_key(task.id)):  # while this call runs it
            return await self._run(ctx, callee, task, text, depth)

    async def _run(
        self, ctx: ToolContext, callee: ap.Agent, task: tp.A2ATask, text: str, depth: int
    ) -> InvokeResult:
        cfg = ctx.agent.invoke
        key = a2a_key(task.id)
        try:
            # The buffer exists before the caller's stream names the task, so a panel can subscribe
            # the moment it sees a2a-task-started.
            metadata = {"agent": callee.slug, "model": callee.model, "kind": "a2a", "taskId": task.id}
            await create_buffer(ctx, key, metadata)
            await ctx.sink.store(
                ev.Event(
                    a2a_task_started=ev.A2ATaskStarted(
                        task_id=task.id,
                        callee_agent_slug=callee.slug,
                        callee_agent_name=callee.name,
                        tool_call_id=ctx.tool_call_id,
                        trace_id=task.trace_id,
                    )
                )
            )
            await self._state(ctx, task.id, tp.TASK_STATE_WORKING)
            outcome = await run_child(
                ctx,
                orc.RunTurnRequest(
                    trace_id=task.trace_id,
                    agent=callee.slug,
                    user_text=text,
                    stream_key=key,
                    stream_created=True,
                    role=A2A_CALLEE,
                    depth=depth,
                    source=tp.MESSAGE_SOURCE_A2A,
                    a2a_task_id=task.id,
                    caller_agent=ctx.agent.slug,
                    caller_session_id=ctx.trace_id,
                    timeout_ms=min(cfg.timeout_ms, callee.limits.timeout_ms),
                    overrides=rt.RunOverrides(model=callee.model, max_output_tokens=cfg.max_output_tokens),
                ),
            )
        except asyncio.CancelledError:
            await to_the_end(self._settle(ctx, key, task.id, Cancelled("the call was cancelled")))
            raise
        except MeshError as err:
            await to_the_end(self._settle(ctx, key, task.id, err))
            raise
        if outcome.ok:
            assert outcome.result is not None
            await self._state(ctx, task.id, tp.TASK_STATE_COMPLETED)
            return InvokeResult(outcome.result.content, True, task.id, task.trace_id)  # @alias/id: remote
        failure = outcome.error or Internal("the callee failed")
        state = tp.TASK_STATE_CANCELED if isinstance(failure, Cancelled) else tp.TASK_STATE_FAILED
        await self._state(ctx, task.id, state)
        return InvokeResult("", False, task.id, task.trace_id, error=failure)

    async def _settle(self, ctx: ToolContext, key: str, task_id: str, err: MeshError) -> None:
        """A call that failed around its child turn: the buffer ends with the error, the task with it."""
        await close_buffer(ctx, key, err)
        state = tp.TASK_STATE_CANCELED if isinstance(err, Cancelled) else tp.TASK_STATE_FAILED
        with contextlib.suppress(MeshError):
            await self._state(ctx, task_id, state)

    @staticmethod
    async def _state(ctx: ToolContext, task_id: str, state: int) -> None:
        await rpc(
            ctx.clients.trace.UpdateA2ATask(ts.UpdateA2ATaskRequest(task_id=task_id, state=state))  # type: ignore[arg-type]
        )


async def resolve_callee(ctx: ToolContext, slug: str) -> Callee:
    """Checks the caller may call `slug` (a local agent, or `@alias/slug` of a registered peer); raises
    before anything is created."""
    allowed = ctx.agent.invoke.allowed_callees
    remote = parse_remote_slug(slug)
    if remote is not None:
        if "*" not in allowed and slug not in allowed:
            raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {slug!r}")
        peer = ctx.clients.peers.registry.resolve(TraceRef("x", alias=remote[0]), current_user())
        return PeerCallee(peer, ctx.clients.peers.http.of(peer), remote[1])
    agent = await ctx.agents.find(slug)
    if agent is None:
        raise NotFound(f"unknown agent {slug!r}")
    if "*" not in allowed and slug not in allowed:
        raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {slug!r}")
    return LocalCallee(agent)


async def agent_invoke(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    started = time.monotonic()
    slug = str(args.get("agentSlug") or "").strip()
    raw = args.get("input")
    continue_from = str(args.get("continueFrom") or "")
    cfg = ctx.agent.invoke
    depth = ctx.depth + 1
    meta: dict[str, Any] = {"agentSlug": slug, "recursionDepth": depth}

    def fail(err: MeshError) -> ToolOutcome:
        meta["durationMs"] = int((time.monotonic() - started) * 1000)
        return ToolOutcome.failed(err, meta)

    if not slug:
        return fail(InvalidArgument("agentSlug is required"))
    inputs = raw if isinstance(raw, list) else [raw]
    if not inputs or not all(isinstance(i, str) and i.strip() for i in inputs):
        return fail(InvalidArgument("input must be a non-empty string or a list of non-empty strings"))
    if len(inputs) > cfg.max_parallel:
        return fail(InvalidArgument(f"at most {cfg.max_parallel} inputs may run in parallel"))
    if continue_from and len(inputs) > 1:
        return fail(InvalidArgument("continueFrom takes a single input"))
    if depth > cfg.max_recursion_depth:
        return fail(DepthExceeded(f"recursion depth {depth} exceeds the limit of {cfg.max_recursion_depth}"))
    try:
        callee = await resolve_callee(ctx, slug)
    except MeshError as err:
        return fail(err)

    async def one(text: str) -> InvokeResult:
        try:
            return await callee.run(ctx, text, continue_from, depth)
        except MeshError as err:  # e.g. continueFrom names no trace of this user
            return InvokeResult("", False, "", "", error=err)

    results = await asyncio.gather(*(one(str(text)) for text in inputs))
    meta["durationMs"] = int((time.monotonic() - started) * 1000)
    if isinstance(raw, list):
        meta["taskIds"] = [r.task_id for r in results]
        meta["traceIds"] = [r.trace_id for r in results]
        ok = all(r.ok for r in results)
        return ToolOutcome({"ok": ok, "results": [r.as_json() for r in results]}, ok=ok, metadata=meta)
    result = results[0]
    meta["taskId"] = result.task_id
    meta["traceId"] = result.trace_id
    return ToolOutcome(result.as_json(), ok=result.ok, metadata=meta)
