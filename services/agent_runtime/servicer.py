"""AgentRuntimeService: a thin adapter over AgentRunner."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Interrupted, InvalidArgument, as_mesh_error, grpc_errors
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
    ) -> AsyncIterator[rt.RunAgentResponse]:
        if not request.agent or not request.stream_key:
            raise InvalidArgument("agent and stream_key are required")
        if request.await_start and not request.history_given:
            raise InvalidArgument("a run that awaits its start is given its history (history_given)")
        # await_start: the model is called at once; nothing is stored before the turn's `start`
        sink = EventSink(
            self.clients,
            request.stream_key,
            await_start=request.await_start,
            live=not request.result_only,
            since=request.start_offset,
        )
        started = sink.started

        async def run() -> rt.RunResult:
            try:
                return await self.runner.run(request, sink)
            finally:
                await sink.aclose()

        task = asyncio.create_task(run(), name=f"run:{request.agent}:{request.trace_id}")
        if started is not None:  # a turn that never started: the run stops at once, storing nothing
            started.add_done_callback(lambda s: None if s.cancelled() or not s.exception() else task.cancel())
        try:
            async for batch in sink.committed():
                if not request.result_only:
                    yield rt.RunAgentResponse(events=rt.EventBatch(events=batch))
            try:
                result = await task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # the caller went away or cancelled: the RPC ends CANCELLED
                failed = (
                    started.exception()
                    if started is not None and started.done() and not started.cancelled()
                    else None
                )
                if failed is not None:  # the turn never started: the run stopped, storing nothing
                    raise as_mesh_error(failed) from None
                # The run was cancelled from inside (nobody cancelled this RPC): a bare CANCELLED
                # status would make its turn end `cancelled`, which nobody asked for.
                log.warning("a run was cancelled from inside the runtime", exc_info=True,
                            extra={"agent": request.agent, "trace": request.trace_id})  # fmt: skip
                raise Interrupted("the run stopped before it ended (cancelled inside the runtime)") from None
            yield rt.RunAgentResponse(result=result)
        finally:
            if not task.done():
                # The caller went away or cancelled: cancel the run and, through it, its child runs.
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            sink.cancel()
