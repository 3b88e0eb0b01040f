"""AgentRuntimeService: a thin adapter over AgentRunner."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc

from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from libs.clients import Clients
from libs.errors import InvalidArgument, grpc_errors
from services.agent_runtime.runner import AgentRunner
from services.agent_runtime.sink import EventSink


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
        sink = EventSink(self.clients, request.stream_key)

        async def run() -> rt.RunResult:
            try:
                return await self.runner.run(request, sink)
            finally:
                await sink.aclose()

        task = asyncio.create_task(run(), name=f"run:{request.agent}:{request.trace_id}")
        try:
            async for batch in sink.committed():
                if not request.result_only:
                    yield rt.RunAgentResponse(events=rt.EventBatch(events=batch))
            result = await task
            yield rt.RunAgentResponse(result=result)
        finally:
            if not task.done():
                # The caller went away or cancelled: cancel the run and, through it, its child runs.
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            sink.cancel()
