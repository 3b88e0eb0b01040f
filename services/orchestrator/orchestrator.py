"""The orchestrator's domain: every turn and every task, through one path (docs/design/turns.md).

A turn runs as a task of its own. A chat turn outlives its caller (it can be resumed from its buffer);
any other turn is cancelled with its call, and with it the tree under it. Someone else's end of a
turn's buffer (a cancel or a delete on any replica) stops it: the engine watches its buffer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.libs.aio import to_the_end
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import DRAIN_SETTLE_S, MeshSettings
from agentmesh.libs.errors import Cancelled, Overloaded, as_mesh_error, from_rpc_error, rpc
from agentmesh.libs.ids import a2a_key, subagent_key, trace_key
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import OrchestratorMetrics
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.services.orchestrator.early import AgentChanged
from agentmesh.services.orchestrator.kinds import Kinds, Resolved
from agentmesh.services.orchestrator.orphans import Orphans
from agentmesh.services.orchestrator.subagents import SubagentBatch
from agentmesh.services.orchestrator.turns import Begun, TurnEngine, ended_error
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

FINAL_TASK_STATES = (
    tp.TASK_STATE_COMPLETED,
    tp.TASK_STATE_FAILED,
    tp.TASK_STATE_CANCELED,
    tp.TASK_STATE_REJECTED,
)
log = logging.getLogger(__name__)


def _resolve(future: asyncio.Future[Begun], begun: Begun) -> None:
    if not future.done():
        future.set_result(begun)


class Orchestrator:
    def __init__(
        self,
        settings: MeshSettings,
        clients: Clients,
        leases: LeaseKeeper | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.engine = TurnEngine(clients, leases, metrics)
        self.kinds = Kinds(clients)
        self.orphans = Orphans(self.engine)
        self.entry_turns = 0  # chat and A2A turns running here (what max_turns bounds)
        # every turn and every subagent batch running here: a drain waits for them, then settles them
        self.turns: set[asyncio.Task[Any]] = set()

    @property
    def leases(self) -> LeaseKeeper:
        return self.engine.leases

    # --- turns --------------------------------------------------------------------------------------

    async def run_turn(self, req: orc.RunTurnRequest) -> AsyncIterator[orc.RunTurnResponse]:
        """The turn `req` asks for: `begun` once it began (a turn that does not begin raises), then
        `ended`."""
        entry = req.WhichOneof("caller") in (None, "chat", "a2a")  # not a callee's or a subagent's
        if entry:
            self._admit()
        resolved = await self.kinds.resolve(req)
        began: asyncio.Future[Begun] = asyncio.get_running_loop().create_future()
        began.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, whoever waits
        task = asyncio.create_task(self._turn(resolved, began), name=f"turn:{resolved.turn.stream_key}")
        self.turns.add(task)
        task.add_done_callback(self.turns.discard)
        if entry:
            self.entry_turns += 1
            self.engine.metrics.running.inc()
            task.add_done_callback(self._left)
        detached = req.WhichOneof("caller") in (None, "chat")
        try:
            begun = await asyncio.shield(began)
            turn = resolved.turn
            yield orc.RunTurnResponse(
                begun=orc.TurnBegun(
                    trace_id=turn.trace_id,
                    stream_key=turn.stream_key,
                    start=begun.start,
                    task_id=turn.task_id,
                    agent_name=turn.agent.name or turn.agent.slug,
                )
            )
            ended = await asyncio.shield(task)
            assert ended is not None
            yield orc.RunTurnResponse(ended=ended)
        finally:
            if not detached and not task.done():  # the caller left: its turn stops, settled
                task.cancel()
                await to_the_end(asyncio.gather(task, return_exceptions=True))

    def _admit(self) -> None:
        """Refuses a new chat or A2A turn at once when this replica runs as many as it may."""
        limit = self.settings.max_turns
        if limit and self.entry_turns >= limit:
            self.engine.metrics.refused.inc()
            raise Overloaded(
                f"the mesh is running {limit} turns, as many as it may; "
                f"try again in {self.settings.retry_after_s} s"
            )

    def _left(self, _: asyncio.Task[Any]) -> None:
        self.entry_turns -= 1
        self.engine.metrics.running.dec()

    async def _turn(self, resolved: Resolved, began: asyncio.Future[Begun]) -> orc.TurnEnded | None:
        try:
            return await self._begin_and_run(resolved, began)
        except AgentChanged:  # its early run dropped, the turn begins again as a new chat of its own
            return await self._begin_and_run(resolved, began)

    async def _begin_and_run(self, resolved: Resolved, began: asyncio.Future[Begun]) -> orc.TurnEnded | None:
        turn, task = resolved.turn, resolved.task
        with self.leases.hold(stream=turn.stream_key, task=task.id if task else ""):
            try:
                begun = await self.engine.begin(turn)
            except AgentChanged:
                raise
            except BaseException as exc:
                if not began.done():
                    began.set_exception(exc if isinstance(exc, Exception) else Cancelled("cancelled"))
                if task is not None:
                    await to_the_end(self._task_state(task.id, self._failed_state(exc)))
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return None
            # The caller hears `begun` once the run's call is under way (engine.run makes it before
            # its first wait): the first delta's path goes first.
            asyncio.get_running_loop().call_soon(_resolve, began, begun)
            working = asyncio.create_task(self._task_state(task.id, tp.TASK_STATE_WORKING)) if task else None
            try:
                ended = await self.engine.run(turn, begun)
            except asyncio.CancelledError as exc:
                if task is not None:
                    await to_the_end(self._task_end(working, task.id, self._failed_state(exc)))
                raise
            if task is not None:
                err = ended_error(ended)
                state = tp.TASK_STATE_COMPLETED if err is None else self._failed_state(err)
                await to_the_end(self._task_end(working, task.id, state))
            return ended

    def _failed_state(self, exc: BaseException) -> int:
        """The task state a turn that failed (or never began) ends in."""
        err = self.engine.cancel_reason() if isinstance(exc, asyncio.CancelledError) else as_mesh_error(exc)
        return tp.TASK_STATE_CANCELED if isinstance(err, Cancelled) else tp.TASK_STATE_FAILED

    async def _task_end(self, working: asyncio.Task[None] | None, task_id: str, state: int) -> None:
        if working is not None:
            await asyncio.gather(working, return_exceptions=True)  # WORKING lands before the end
        await self._task_state(task_id, state)

    async def _task_state(self, task_id: str, state: int) -> None:
        request = tks.UpdateA2ATaskRequest(task_id=task_id, state=state)  # type: ignore[arg-type]
        try:
            await self.clients.tasks.UpdateA2ATask(request, timeout=self.engine.grace_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                return  # final already: a cancel settled it first
            log.warning("could not move task %s: %s", task_id, exc.details(), extra={"task": task_id})

    async def run_subagents(self, req: orc.RunSubagentsRequest) -> AsyncIterator[orc.RunSubagentsResponse]:
        """A delegate call's subagents, each a turn of the engine; cancelled with the call unless they
        run in the background."""
        batch = SubagentBatch(
            self.engine, self.kinds, req, self.turns, max_background=self.settings.subagent.max_background
        )
        async for response in batch.run():
            yield response

    # --- cancel and delete --------------------------------------------------------------------------

    async def cancel(self, req: orc.CancelTurnRequest) -> bool:
        """Cancels the running turn of a trace, a task or a subagent of the calling user (NOT_FOUND for
        anyone else's): its buffer ends `cancelled`, and the replica running it stops it (its engine
        watches the buffer; a subagent still queued is settled by its batch). Always settles: what a
        turn that died with its process left pending (the trace's placeholder, the task's state) is
        marked cancelled too; a subagent's row is its batch's, or its lease's."""
        if req.WhichOneof("target") == "subagent_id":
            get = sbs.GetSubagentSessionRequest(subagent_id=req.subagent_id)
            row = (await rpc(self.clients.subagents.GetSubagentSession(get))).subagent
            return await self._cancel_buffer(subagent_key(row.id))
        if req.WhichOneof("target") == "task_id":
            task = (await rpc(self.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=req.task_id)))).task
            closed = await self._cancel_buffer(a2a_key(task.id))
            # Its buffer ended `cancelled` (or is gone with a dead turn): so did the task, at once.
            if closed or task.state not in FINAL_TASK_STATES:
                await self._task_state(task.id, tp.TASK_STATE_CANCELED)
                return True
            return False
        trace = (await rpc(self.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=req.trace_id)))).trace
        closed = await self._cancel_buffer(trace_key(trace.id))
        try:
            settled = await self._settle_head(trace)
        except grpc.aio.AioRpcError as exc:  # the cancel itself succeeded; the rest is tidying
            log.warning("could not settle the head of %s: %s", trace.id, exc.details())
            settled = False
        return closed or settled

    async def _cancel_buffer(self, key: str) -> bool:
        """Ends `key` `cancelled`; False when it was ended already, or is gone."""
        request = ss.CloseStreamRequest(key=key, error=Cancelled("cancelled by the user").to_event())
        try:
            return (await self.clients.stream.CloseStream(request)).closed
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # no buffer: maybe something pending is left
                raise from_rpc_error(exc) from exc
            return False

    async def _settle_head(self, trace: tp.Trace) -> bool:
        """A turn that died with its process left its placeholder (the head) pending: marked cancelled.
        A live turn marks it the same way, so the two cannot disagree."""
        if not trace.head_sequence:
            return False
        head = await self.clients.messages.ListMessages(
            ms.ListMessagesRequest(
                trace_id=trace.id, head_sequence=trace.head_sequence, since_sequence=trace.head_sequence - 1
            )
        )
        settled = False
        for message in head.messages:
            if message.role == tp.MESSAGE_ROLE_ASSISTANT and message.status == tp.MESSAGE_STATUS_PENDING:
                await self.clients.messages.UpdateMessage(
                    ms.UpdateMessageRequest(
                        message=tp.Message(id=message.id, status=tp.MESSAGE_STATUS_CANCELLED),
                        update_mask=field_mask_pb2.FieldMask(paths=["status"]),
                    )
                )
                settled = True
        return settled

    async def delete(self, trace_id: str | None) -> tuple[int, int]:
        """Deletes a trace of the calling user (None: every one) and everything under it; returns
        (traces removed, buffers ended). The rows go first, then every buffer of the tree ends
        `cancelled` (the turns running on any replica stop: their engines watch their buffers) and
        becomes unreadable."""
        if trace_id is None:
            deleted = await rpc(self.clients.trace.DeleteTraces(ts.DeleteTracesRequest()))
        else:
            deleted = await rpc(self.clients.trace.DeleteTrace(ts.DeleteTraceRequest(trace_id=trace_id)))
        keys = [
            *(trace_key(t) for t in deleted.deleted_trace_ids),
            *(a2a_key(t) for t in deleted.deleted_task_ids),
            *(subagent_key(s) for s in deleted.deleted_subagent_ids),
        ]
        error = Cancelled("the trace was deleted").to_event()
        resp = await rpc(self.clients.stream.DeleteStreams(ss.DeleteStreamsRequest(keys=keys, error=error)))
        return len(deleted.deleted_trace_ids), resp.deleted_count

    async def drain(self, grace_s: float) -> None:
        """Shutdown: running turns finish within the grace; the rest end `interrupted`, each settled
        (its placeholder, its task, its buffer, the turns under it) before the process exits."""
        self.engine.stopping = True  # from now on a turn cut short is interrupted, not cancelled
        tasks = [t for t in self.turns if not t.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending, timeout=DRAIN_SETTLE_S)
