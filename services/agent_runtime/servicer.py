"""AgentRuntimeService: a thin adapter over AgentRunner."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from agentmesh.libs import events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import Interrupted, InvalidArgument, MeshError, grpc_errors
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.runtime.v1 import runtime_service_pb2_grpc as rt_grpc
from agentmesh.services.agent_runtime.runner import AgentRunner
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.stream.v1 import stream_service_pb2 as ss

log = logging.getLogger(__name__)


ORPHAN_WAIT_S = 2.0  # how long a run's turn may take to end after its caller left, before it is an orphan
SETTLE_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)


class AgentRuntimeServicer(rt_grpc.AgentRuntimeServiceServicer):
    def __init__(self, runner: AgentRunner, clients: Clients) -> None:
        self.runner = runner
        self.clients = clients
        self.orphans: set[asyncio.Task[None]] = set()

    def _caller_left(self, stream: rt.StreamRef) -> None:
        """The run's caller went away (its orchestrator cancelled the run, or died): the turn's end is
        its owner's, unless the owner is gone too — then settled from here, in the background."""
        task = asyncio.create_task(self._settle_orphan(stream), name=f"orphan:{stream.key}")
        self.orphans.add(task)
        task.add_done_callback(self.orphans.discard)

    async def _settle_orphan(self, stream: rt.StreamRef) -> None:
        """When the turn's buffer has not ended ORPHAN_WAIT_S after its caller left, its owner is gone:
        the buffer ends `interrupted` at once (every reader gets its terminal event), and an
        orchestrator settles the rows (EndOrphanedTurn, tried until one answers, within the lease)."""
        if await self._ends_within(stream.key, ORPHAN_WAIT_S):
            return
        log.warning("a run's turn outlived its orchestrator: settling it", extra={"key": stream.key})
        gone = Interrupted("the orchestrator running this turn went away; what it streamed is kept")
        close = ss.CloseStreamRequest(key=stream.key, error=gone.to_event(), since=stream.start_offset)
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.clients.stream.CloseStream(close, timeout=ORPHAN_WAIT_S)
        request = orc.EndOrphanedTurnRequest(stream=stream)
        deadline = asyncio.get_running_loop().time() + self.clients.settings.lease_s
        for attempt in range(1_000):
            try:
                await self.clients.orchestrator.EndOrphanedTurn(request, timeout=ORPHAN_WAIT_S * 2)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                    log.warning(
                        "could not settle an orphaned turn: %s", exc.details(), extra={"key": stream.key}
                    )
                    return  # the lease's reaper settles it
            await asyncio.sleep(SETTLE_BACKOFF_S[min(attempt, len(SETTLE_BACKOFF_S) - 1)])

    async def _ends_within(self, key: str, wait_s: float) -> bool:
        """Whether `key` ends (with any terminal event) within `wait_s`."""
        follow = self.clients.follows.follow(key, "", int(wait_s * 1000), terminal_only=True)
        try:
            async with asyncio.timeout(wait_s):
                async for event in follow:
                    return events.is_terminal(event)
        except (MeshError, TimeoutError):
            return False
        finally:
            follow.cancel()
        return False

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
                self._caller_left(request.stream)
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
