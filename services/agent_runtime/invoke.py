"""agent-invoke: live, persisted, cancellable agent-to-agent calls (docs/requirements.md#invoke-live-stream;
docs/requirements.md#one-invoke-engine: a list of inputs run in parallel, continue_from a trace).

A callee is anything with `Callee.run`; `LocalCallee` runs an agent of this mesh as a child turn
through the orchestrator. A remote A2A agent is one more implementation of the same interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol

from google.protobuf import field_mask_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, telemetry
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.errors import (
    Cancelled,
    DepthExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    PermissionDenied,
    rpc,
)
from agentmesh.libs.identity import current_user
from agentmesh.libs.ids import TraceRef, a2a_key, shown
from agentmesh.libs.turns import turn_messages, turn_start
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.a2a_client import RemoteAgent
from agentmesh.services.agent_runtime.children import (
    close_buffer,
    create_buffer,
    create_task,
    run_child,
    set_task_state,
    settle_task,
)
from agentmesh.services.agent_runtime.peer_agents import PeerCallee, parse_remote_slug
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.services.agent_runtime.tools import A2A_CALLEE, ToolContext, ToolOutcome
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)


@dataclass
class InvokeResult:
    output: str
    ok: bool
    task_id: str
    trace_id: str
    error: MeshError | None = None
    remote: bool = False  # the trace lives on a peer (trace_id is location-bearing)
    local_trace_id: str = ""  # a remote callee: our copy of the exchange (traceId names the remote's)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "output": self.output,
            "ok": self.ok,
            "taskId": self.task_id,
            "traceId": self.trace_id,
        }
        if self.remote or not TraceRef.parse(self.trace_id or "x").is_local:
            out["remote"] = True
        if self.local_trace_id:
            out["localTraceId"] = self.local_trace_id
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
        task = await create_task(ctx, callee.slug, depth, continue_trace_id=continue_from)
        with ctx.leases.hold(task=task.id, stream=a2a_key(task.id)):  # while this call runs it
            return await self._run(ctx, callee, task, text, depth, not continue_from)

    async def _run(
        self, ctx: ToolContext, callee: ap.Agent, task: tp.A2ATask, text: str, depth: int, new: bool
    ) -> InvokeResult:
        """`new`: the task's hidden trace was just created (it has no messages yet)."""
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
            await set_task_state(ctx, task.id, tp.TASK_STATE_WORKING)
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
                    resolved_agent=callee,  # as resolve_callee just read it
                    empty_trace=new,
                ),
            )
        except asyncio.CancelledError:
            await to_the_end(settle_task(ctx, key, task.id, Cancelled("the call was cancelled")))
            raise
        except MeshError as err:
            await to_the_end(settle_task(ctx, key, task.id, err))
            raise
        if outcome.ok:
            assert outcome.result is not None
            await set_task_state(ctx, task.id, tp.TASK_STATE_COMPLETED)
            return InvokeResult(outcome.result.content, True, task.id, task.trace_id)  # @alias/id: remote
        failure = outcome.error or Internal("the callee failed")
        state = tp.TASK_STATE_CANCELED if isinstance(failure, Cancelled) else tp.TASK_STATE_FAILED
        await set_task_state(ctx, task.id, state)
        return InvokeResult("", False, task.id, task.trace_id, error=failure)


def credential(name: str) -> str:
    """The Bearer token a remote agent's `credentialEnv` names, read at call time from this process's
    environment: the variable itself, else the file `<name>_FILE` names (a mounted secret)."""
    if not name:
        return ""
    value = os.environ.get(name, "")
    if not value and os.environ.get(f"{name}_FILE"):
        try:
            with open(os.environ[f"{name}_FILE"], encoding="utf-8") as f:
                value = f.read().strip()
        except OSError:
            value = ""
    return value


class RemoteCallee:
    """A remote A2A agent of the catalog (`remote.cardUrl`), called with the a2a-sdk client
    (services/agent_runtime/a2a_client.py). Its reply streams into `a2a:<task id>` like a local
    callee's, and is persisted in a hidden trace of ours (source a2a) with the remote task and context;
    the tool's traceId names the remote trace where it lives: agent://host[:port]/<contextId>."""

    def __init__(self, agent: ap.Agent) -> None:
        self.agent = agent

    def client(self, ctx: ToolContext) -> RemoteAgent:
        remote = self.agent.remote
        return RemoteAgent(
            remote.card_url, credential(remote.credential_env), timeout_s=ctx.agent.invoke.timeout_ms / 1000
        )

    async def run(self, ctx: ToolContext, text: str, continue_from: str, depth: int) -> InvokeResult:
        remote = self.client(ctx)
        context_id = ""
        if continue_from:
            ref = TraceRef.parse(continue_from)
            if ref.authority != remote.authority:
                raise InvalidArgument(f"continueFrom {continue_from!r} is not a trace of {self.agent.slug!r}")
            context_id = ref.id
        card = await remote.resolve()  # an unreachable card or a refused key: no task is created
        task = await create_task(ctx, self.agent.slug, depth, remoteUrl=self.agent.remote.card_url)
        with ctx.leases.hold(task=task.id, stream=a2a_key(task.id)):
            return await self._run(ctx, remote, card.name, task, text, context_id, depth)

    async def _run(
        self,
        ctx: ToolContext,
        remote: RemoteAgent,
        name: str,
        task: tp.A2ATask,
        text: str,
        context_id: str,
        depth: int,
    ) -> InvokeResult:
        key = a2a_key(task.id)
        slug = self.agent.slug
        meta: dict[str, Any] = {"remoteUrl": self.agent.remote.card_url, "remoteAgent": name}
        streamed: list[str] = []
        placeholder: tp.Message | None = None
        callee: EventSink | None = None
        try:
            await create_buffer(ctx, key, {"agent": slug, "model": name, "kind": "a2a", "taskId": task.id})
            await ctx.sink.store(
                ev.Event(
                    a2a_task_started=ev.A2ATaskStarted(
                        task_id=task.id,
                        callee_agent_slug=slug,
                        callee_agent_name=name,
                        tool_call_id=ctx.tool_call_id,
                        trace_id=task.trace_id,
                    )
                )
            )
            await set_task_state(ctx, task.id, tp.TASK_STATE_WORKING)
            user, pending = turn_messages(
                task.trace_id,
                text,
                source=tp.MESSAGE_SOURCE_A2A,
                a2a_task_id=task.id,
                caller_agent=ctx.agent.slug,
                caller_session_id=ctx.trace_id,
            )
            begun = await rpc(
                ctx.clients.messages.BeginTurn(
                    ms.BeginTurnRequest(trace_id=task.trace_id, user_message=user, assistant_message=pending)
                )
            )
            placeholder = begun.assistant_message
            callee = EventSink(ctx.clients, key)
            callee.emit(turn_start(task.trace_id, begun.user_message.id, placeholder.id, slug))

            def on_text(chunk: str) -> None:
                streamed.append(chunk)
                assert callee is not None
                callee.emit(events.text_delta(chunk))

            def on_task(remote_task: str, remote_context: str) -> None:
                meta.update(remoteTaskId=remote_task, remoteContextId=remote_context)

            with telemetry.span(f"remote-agent {slug}", agent=slug, url=self.agent.remote.card_url):
                reply = await remote.call(
                    text, on_text=on_text, on_task=on_task, context_id=context_id, depth=depth
                )
        except asyncio.CancelledError:
            await to_the_end(
                self._settle(
                    ctx, key, task, placeholder, callee, streamed, meta, Cancelled("the call was cancelled")
                )
            )
            raise
        except MeshError as err:
            await to_the_end(self._settle(ctx, key, task, placeholder, callee, streamed, meta, err))
            return InvokeResult(
                "".join(streamed),
                False,
                task.id,
                self._ref(remote, meta),
                error=err,
                local_trace_id=task.trace_id,
            )
        usage = ev.Usage(input_tokens=reply.input_tokens, output_tokens=reply.output_tokens)
        await rpc(
            ctx.clients.messages.UpdateMessage(
                ms.UpdateMessageRequest(
                    message=tp.Message(
                        id=placeholder.id,
                        content=reply.text,
                        model=name,
                        usage=usage,
                        metadata=events.struct(meta),
                        status=tp.MESSAGE_STATUS_COMPLETED,
                    ),
                    update_mask=field_mask_pb2.FieldMask(
                        paths=["content", "model", "usage", "metadata", "status"]
                    ),
                )
            )
        )
        callee.emit(ev.Event(finish=ev.TurnFinish(usage=usage, model=name)))
        await callee.aclose()
        await rpc(ctx.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone())))
        await set_task_state(ctx, task.id, tp.TASK_STATE_COMPLETED)
        return InvokeResult(reply.text, True, task.id, self._ref(remote, meta), local_trace_id=task.trace_id)

    @staticmethod
    def _ref(remote: RemoteAgent, meta: dict[str, Any]) -> str:
        """agent://host[:port]/<remote contextId> ("" when the remote named none we can carry)."""
        context_id = str(meta.get("remoteContextId") or "")
        try:
            return str(TraceRef(context_id, host=remote.host, port=int(remote.port or 0)))
        except MeshError:
            return ""

    async def _settle(
        self,
        ctx: ToolContext,
        key: str,
        task: tp.A2ATask,
        placeholder: tp.Message | None,
        callee: EventSink | None,
        streamed: list[str],
        meta: dict[str, Any],
        err: MeshError,
    ) -> None:
        """A call that failed: what streamed is kept on the message, marked failed or cancelled with the
        error; the buffer ends with it; the task too."""
        cancelled = isinstance(err, Cancelled)
        if callee is not None:
            with contextlib.suppress(Exception):
                await callee.aclose()
        if placeholder is not None:
            meta["error"] = {"code": err.code_name, "message": err.message}
            with contextlib.suppress(MeshError):
                await rpc(
                    ctx.clients.messages.UpdateMessage(
                        ms.UpdateMessageRequest(
                            message=tp.Message(
                                id=placeholder.id,
                                content="".join(streamed),
                                metadata=events.struct(meta),
                                status=tp.MESSAGE_STATUS_CANCELLED if cancelled else tp.MESSAGE_STATUS_FAILED,
                            ),
                            update_mask=field_mask_pb2.FieldMask(paths=["content", "metadata", "status"]),
                        )
                    )
                )
        await close_buffer(ctx, key, err)
        with contextlib.suppress(MeshError):
            await set_task_state(ctx, task.id, tp.TASK_STATE_CANCELED if cancelled else tp.TASK_STATE_FAILED)


def _same_url(a: str, b: str) -> bool:
    def norm(url: str) -> str:
        url = url.strip().rstrip("/")
        return url.removesuffix("/.well-known/agent-card.json").rstrip("/")

    return bool(a.strip()) and norm(a) == norm(b)


async def resolve_callee(ctx: ToolContext, slug: str, url: str = "") -> Callee:
    """Checks the caller may call `slug` (or the catalogued remote agent whose card is at `url`);
    raises before anything is created. A URL no agent of the catalog names is never contacted."""
    allowed = ctx.agent.invoke.allowed_callees
    remote = parse_remote_slug(slug)
    if remote is not None:  # `@alias/slug`: agent `slug` of the registered peer `alias`
        if "*" not in allowed and slug not in allowed:
            raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {slug!r}")
        peer = ctx.clients.peers.registry.resolve(TraceRef("x", alias=remote[0]), current_user())
        return PeerCallee(peer, ctx.clients.peers.http.of(peer), remote[1])
    if url:
        listed = (await rpc(ctx.clients.agents.ListAgents(ag.ListAgentsRequest()))).agents
        matches = [a for a in listed if a.HasField("remote") and _same_url(a.remote.card_url, url)]
        if not matches:
            raise PermissionDenied(f"{shown(url)} is not a remote agent of the catalog")
        slug = matches[0].slug
        agent: ap.Agent | None = matches[0]
    else:
        agent = await ctx.agents.find(slug)
    if agent is None:
        raise NotFound(f"unknown agent {slug!r}")
    if "*" not in allowed and slug not in allowed:
        raise PermissionDenied(f"agent {ctx.agent.slug!r} may not call {slug!r}")
    return RemoteCallee(agent) if agent.HasField("remote") else LocalCallee(agent)


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
        callee = await resolve_callee(ctx, slug, url)
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
