"""Child turns (an agent-invoke callee, a subagent) run through the orchestrator's turn engine
(OrchestratorService.RunTurn), which persists them like any turn. Cancelling the awaiting tool cancels
the call, and with it the child turn and everything under it."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import grpc

from agentmesh.libs import events, telemetry
from agentmesh.libs.errors import Cancelled, MeshError, from_event, from_rpc_error, rpc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.tools import ToolContext
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp

GRACE_S = 5.0  # the child's own deadline fires first; the call's deadline is a backstop


@dataclass
class ChildOutcome:
    result: rt.RunResult | None = None
    error: MeshError | None = None
    user_message_id: int = 0
    assistant_message_id: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None


async def create_task(
    ctx: ToolContext, callee: str, depth: int, continue_trace_id: str = "", **context: str
) -> tp.A2ATask:
    """The `a2a_tasks` row (and its hidden trace) of one agent-invoke call by this run's agent, with
    where the call came from (tool call, depth, anchor message; `context` adds to it)."""
    caller_context = {
        "toolCallId": ctx.tool_call_id,
        "depth": depth,
        "anchorMessageId": ctx.anchor_message_id,
        **context,
    }
    request = tks.CreateA2ATaskRequest(
        task=tp.A2ATask(
            callee_agent=callee,
            caller_agent=ctx.agent.slug,
            caller_trace_id=ctx.trace_id,
            caller_context=events.struct(caller_context),
        ),
        continue_trace_id=continue_trace_id,
    )
    return (await rpc(ctx.clients.tasks.CreateA2ATask(request))).task


async def set_task_state(ctx: ToolContext, task_id: str, state: int) -> None:
    await rpc(ctx.clients.tasks.UpdateA2ATask(tks.UpdateA2ATaskRequest(task_id=task_id, state=state)))  # type: ignore[arg-type]


async def settle_task(ctx: ToolContext, key: str, task_id: str, err: MeshError) -> None:
    """A call that failed around its child turn: the buffer ends with the error, the task with it."""
    await close_buffer(ctx, key, err)
    state = tp.TASK_STATE_CANCELED if isinstance(err, Cancelled) else tp.TASK_STATE_FAILED
    with contextlib.suppress(MeshError):
        await set_task_state(ctx, task_id, state)


async def create_buffer(ctx: ToolContext, key: str, metadata: dict[str, str]) -> None:
    """Creates a child's buffer before anyone learns its key (so a reader never finds it missing)."""
    await rpc(ctx.clients.stream.CreateStream(ss.CreateStreamRequest(key=key, metadata=metadata)))


async def close_buffer(ctx: ToolContext, key: str, err: MeshError) -> None:
    """Ends a child's buffer with `err` unless it has ended already (the turn engine closes it when it
    ran; this covers a turn that never started)."""
    try:
        await ctx.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=err.to_event()))
    except grpc.aio.AioRpcError:
        pass  # gone already: nothing left to end


async def run_child(ctx: ToolContext, request: orc.RunTurnRequest) -> ChildOutcome:
    """Runs the child turn to its end; a failure is in the outcome, a cancellation propagates."""
    timeout_s = request.timeout_ms / 1000 + GRACE_S if request.timeout_ms else ctx.settings.turn_timeout_s
    with telemetry.span(
        f"child-run {request.agent}",
        agent=request.agent,
        trace_id=request.trace_id,
        stream_key=request.stream_key,
        depth=request.depth,
    ) as span:
        try:
            resp = await ctx.clients.orchestrator.RunTurn(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            telemetry.fail(span, err.code_name, err.message)
            if request.stream_created:
                await close_buffer(ctx, request.stream_key, err)
            return ChildOutcome(error=err)
        out = ChildOutcome(
            user_message_id=resp.user_message_id, assistant_message_id=resp.assistant_message_id
        )
        if resp.HasField("result"):
            out.result = resp.result
        else:
            out.error = from_event(resp.error)
            telemetry.fail(span, out.error.code_name, out.error.message)
        return out
