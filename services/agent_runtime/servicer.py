"""AgentRuntimeService: a thin adapter over AgentRunner."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Interrupted, InvalidArgument, grpc_errors
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from agentmesh.services.agent_runtime.runner import AgentRunner
from agentmesh.services.agent_runtime.sink import EventSink

log = logging.getLogger(__name__)


class AgentRuntimeServicer(rt_grpc.AgentRuntimeServiceServicer):
    def __init__(self, runner: AgentRunner, clients: Clients) -> None:
        self.runner = runner
        self.clients = clients

    @grpc_errors
    async def RunAgent(
        self, request: rt.RunAgentRequest, context: grpc.aio.ServicerContext
    ) -> rt.RunAgentResponse:
        identity.current_user()  # a run acts for a user (its turn's), never as the mesh itself
        if not request.agent.slug or not request.stream.key:
            raise InvalidArgument("agent and stream are required")
        if request.agent.limits.max_steps < 1 and not request.agent.HasField("remote"):
            raise InvalidArgument("the agent's limits.max_steps must be at least 1")
        sink = EventSink(self.clients, request.stream.key, since=request.stream.start_offset)
        remaining = context.time_remaining()

        async def run() -> rt.RunResult:
            try:
                return await self.runner.run(request, sink, remaining)
            finally:
                await sink.aclose()

        task = asyncio.create_task(run(), name=f"run:{request.agent.slug}:{request.trace_id}")
        try:
            return rt.RunAgentResponse(result=await task)
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # the caller went away or cancelled: the RPC ends CANCELLED
            # The run was cancelled from inside (nobody cancelled this RPC): a bare CANCELLED status
            # would make its turn end `cancelled`, which nobody asked for.
            log.warning("a run was cancelled from inside the runtime", exc_info=True,
                        extra={"agent": request.agent.slug, "trace": request.trace_id})  # fmt: skip
            raise Interrupted("the run stopped before it ended (cancelled inside the runtime)") from None
        finally:
            if not task.done():
                # The caller went away or cancelled: cancel the run and, through it, its child turns.
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            sink.cancel()
