"""agent-invoke: live, persisted, cancellable agent-to-agent calls (docs/requirements.md#agent-invoke;
docs/requirements.md#one-invoke-engine: a list of inputs run in parallel, continueFrom a trace).

The tool checks that this run's agent may call the callee, then asks the orchestrator for the callee's
turn (RunTurn with an invoke caller): the callee runs there like every turn, as an A2A task of ours
with its own buffer, whether it is an agent of this mesh, a remote A2A agent of the catalog or a
registered peer's. Once the turn began, `a2a-task-started` tells the caller's readers where to
follow it. Cancelling the tool cancels the call, and with it the callee's turn and its tree.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, telemetry
from agentmesh.libs.errors import (
    DepthExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    from_event,
    from_rpc_error,
    rpc,
)
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import TraceRef, shown
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.services.agent_runtime.remotes import parse_peer_slug
from agentmesh.services.agent_runtime.tools import ToolContext, ToolOutcome

GRACE_S = 5.0  # the callee's own limit ends its turn first; the call's deadline is a backstop


@dataclass
class InvokeResult:
    output: str
    ok: bool
    task_id: str
    trace_id: str  # where the callee's turn happened (location-bearing when not here)
    error: MeshError | None = None
    local_trace_id: str = ""  # a remote callee: our record of the exchange
    remote: bool = False  # the callee is a remote or a peer's agent

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output": self.output,
            "ok": self.ok,
            "taskId": self.task_id,
            "traceId": self.trace_id,
        }
        if self.remote or (self.trace_id and not TraceRef.parse(self.trace_id).is_local):
            out["remote"] = True
        if self.local_trace_id and self.local_trace_id != self.trace_id:
            out["localTraceId"] = self.local_trace_id
        if self.error is not None:
            out["error"] = self.error.message
            out["code"] = self.error.code_name
        return out


def _same_url(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        url = url.strip().rstrip("/")
        return url.removesuffix("/.well-known/agent-card.json").rstrip("/")

    return bool(a.strip()) and norm(a) == norm(b)


async def resolve_callee(ctx: ToolContext, slug: str, url: str = "") -> tuple[str, bool]:
    """The slug to call, and whether it is a remote or a peer's agent: checks the caller may call
    `slug` (or the catalogued remote agent whose card is at `url`), before anything is created. A URL
    no agent of the catalog names is never contacted."""
    allowed = ctx.agent.invoke.allowed_callees
    if parse_peer_slug(slug) is not None:  # `@alias/slug`: agent `slug` of the registered peer `alias`
        if "*" not in allowed and slug not in allowed:
            raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {slug!r}")
        ctx.clients.peers.registry.resolve(TraceRef("x", alias=slug[1:].split("/", 1)[0]), current_user())
        return slug, True
    agent: ap.Agent | None
    if url:
        listed = (await rpc(ctx.clients.agents.ListAgents(ag.ListAgentsRequest()))).agents
        matches = [a for a in listed if a.HasField("remote") and _same_url(a.remote.card_url, url)]
        if not matches:
            raise PermissionDenied(f"{shown(url)} is not a remote agent of the catalog")
        agent = matches[0]
    else:
        agent = await ctx.agents.find(slug)
    if agent is None:
        raise NotFound(f"unknown agent {slug!r}")
    if "*" not in allowed and agent.slug not in allowed:
        raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {agent.slug!r}")
    return agent.slug, agent.HasField("remote")


async def call_callee(
    ctx: ToolContext, slug: str, text: str, continue_from: str, depth: int, remote: bool = False
) -> InvokeResult:
    """One callee turn, to its end: its result, or why it failed (a cancel propagates)."""
    cfg = ctx.agent.invoke
    request = orc.RunTurnRequest(
        trace_id=continue_from,
        agent=slug,
        input=text,
        invoke=orc.InvokeCaller(
            agent=ctx.agent.slug,
            trace_id=ctx.trace_id,
            tool_call_id=ctx.tool_call_id,
            anchor_message_id=ctx.anchor_message_id,
            depth=depth,
        ),
        limits=orc.TurnLimits(timeout_ms=cfg.timeout_ms, max_output_tokens=cfg.max_output_tokens),
    )
    timeout_s = cfg.timeout_ms / 1000 + GRACE_S if cfg.timeout_ms else ctx.settings.turn_timeout_s
    begun: orc.TurnBegun | None = None
    ended: orc.TurnEnded | None = None
    started: Announcement | None = None
    with telemetry.span(f"agent-invoke {slug}", agent=slug, depth=depth) as span:
        call = ctx.clients.orchestrator.RunTurn(request, timeout=timeout_s)
        try:
            async for response in call:  # to its end: `begun`, then `ended`
                if response.HasField("begun"):
                    begun = response.begun
                    started = Announcement(ctx, slug, begun, remote)
                else:
                    ended = response.ended
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            telemetry.fail(span, err.code_name, err.message)
            where = await started.settle("") if started else ""
            return InvokeResult("", False, begun.task_id if begun else "", where, error=err)
        except BaseException:
            if started is not None:
                started.cancel()
            raise
        finally:
            call.cancel()
    if ended is None or started is None or begun is None:
        return InvokeResult("", False, "", "", error=Internal(f"the turn of {slug} ended without an outcome"))
    where = await started.settle(ended.trace_ref)
    local = begun.trace_id if where != begun.trace_id else ""
    if ended.HasField("error"):
        err = from_event(ended.error)
        return InvokeResult(ended.message.content, False, begun.task_id, where, err, local)
    return InvokeResult(ended.result.content, True, begun.task_id, where, local_trace_id=local)


class Announcement:
    """`a2a-task-started` in the caller's buffer, naming the trace where the callee's turn runs
    (docs/federation.md#trace-ids-in-events-and-results): for an agent of ours at once; for a remote
    callee once the remote took the task (`remote-task-started` in the callee's buffer), or when its
    turn ended without that."""

    def __init__(self, ctx: ToolContext, slug: str, begun: orc.TurnBegun, remote: bool) -> None:
        self.ctx, self.slug, self.begun = ctx, slug, begun
        self.where = ""  # the trace id announced
        self.task = asyncio.create_task(self._run(remote), name=f"announce:{begun.task_id}")

    async def _run(self, remote: bool) -> None:
        await self._store(await self._located() if remote else self.begun.trace_id)

    async def _located(self) -> str:
        """The remote's trace, from the callee's buffer ("" when the turn ended without one)."""
        follow = self.ctx.clients.follows.follow(self.begun.stream_key, from_offset=self.begun.start.offset)
        try:
            async for event in follow:
                if event.HasField("remote_task_started"):
                    return event.remote_task_started.trace_id
                if events.is_terminal(event):
                    return ""
        except MeshError:
            return ""
        finally:
            follow.cancel()
        return ""

    async def _store(self, where: str) -> None:
        if self.where:
            return
        self.where = where or self.begun.trace_id
        begun = self.begun
        local = begun.trace_id if self.where != begun.trace_id else ""
        started = ev.A2ATaskStarted(
            task_id=begun.task_id,
            callee_agent_slug=self.slug,
            callee_agent_name=begun.agent_name,
            tool_call_id=self.ctx.tool_call_id,
            trace_id=self.where,
            local_trace_id=local,
        )
        await self.ctx.sink.store(ev.Event(a2a_task_started=started))

    async def settle(self, fallback: str) -> str:
        """The trace announced, once it is: the turn ended, so its buffer has (or soon has) its end and
        the remote's trace when it took the task; else `fallback` (where the turn ended saying it ran)."""
        try:
            await asyncio.wait_for(asyncio.shield(self.task), GRACE_S)
        except (TimeoutError, MeshError):
            self.task.cancel()
        await self._store(fallback)
        return self.where

    def cancel(self) -> None:
        if not self.task.done():
            self.task.cancel()


async def agent_invoke(ctx: ToolContext, args: dict[str, Any]) -> ToolOutcome:
    started = time.monotonic()
    slug = str(args.get("agentSlug") or "").strip()
    url = str(args.get("agentUrl") or "").strip()
    raw = args.get("input")
    continue_from = str(args.get("continueFrom") or "")
    cfg = ctx.agent.invoke
    depth = ctx.depth + 1
    meta: dict[str, Any] = {"agentSlug": slug, "recursionDepth": depth}
    if url:
        meta["agentUrl"] = url

    def fail(err: MeshError) -> ToolOutcome:
        meta["durationMs"] = int((time.monotonic() - started) * 1000)
        return ToolOutcome.failed(err, meta)

    if not slug and not url:
        return fail(InvalidArgument("agentSlug or agentUrl is required"))
    if slug and url:
        return fail(InvalidArgument("give agentSlug or agentUrl, not both"))
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
        callee, remote = await resolve_callee(ctx, slug, url)
    except MeshError as err:
        return fail(err)
    results = await asyncio.gather(
        *(call_callee(ctx, callee, str(t), continue_from, depth, remote) for t in inputs)
    )
    for result in results:
        result.remote = remote
    meta["durationMs"] = int((time.monotonic() - started) * 1000)
    if isinstance(raw, list):
        meta["taskIds"] = [r.task_id for r in results]
        meta["traceIds"] = [r.trace_id for r in results]
        ok = all(r.ok for r in results)
        return ToolOutcome({"ok": ok, "results": [r.as_json() for r in results]}, ok=ok, metadata=meta)
    result = results[0]
    meta["taskId"] = result.task_id
    meta["traceId"] = result.trace_id
    if result.local_trace_id and result.local_trace_id != result.trace_id:
        meta["localTraceId"] = result.local_trace_id
    return ToolOutcome(result.as_json(), ok=result.ok, metadata=meta)
