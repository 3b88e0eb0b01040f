"""Child turns (an agent-invoke callee, a subagent) run through the orchestrator's turn engine
(OrchestratorService.RunTurn), which persists them like any turn. Cancelling the awaiting tool cancels
the call, and with it the child turn and everything under it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.stream.v1 import stream_service_pb2 as ss
from libs import telemetry
from libs.errors import MeshError, from_event, from_rpc_error, rpc
from services.agent_runtime.tools import ToolContext

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
