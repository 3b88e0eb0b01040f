"""A supervisor's delegate call: its subagents, each a turn of the engine in a hidden trace of its own
(docs/requirements.md#session-subagents, docs/design/turns.md "Subagents").

The rows (each with its turn's messages) are created in one call, the buffers, each born with its
turn's `start`, in another, before anyone learns of them (a reader of a card always finds its buffer).
At most `max_concurrent` run at once; the rest wait `queued` (a stop while one waits ends it there). A
failure or a timeout touches only its own subagent. Each change of a row is reported to the caller as
it is stored. A background batch (docs/agents.md#background-subagents) is the same batch whose call
ends once its rows exist: its subagents run on without it, each settled the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from google.protobuf import field_mask_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import (
    Cancelled,
    InvalidArgument,
    MeshError,
    ResourceExhausted,
    as_mesh_error,
    from_event,
    rpc,
)
from agentmesh.libs.ids import subagent_key
from agentmesh.libs.protojson import enum_to_str
from agentmesh.libs.tools import MAX_DELEGATE_TASKS
from agentmesh.libs.turns import turn_start
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.orchestrator.kinds import Kinds
from agentmesh.services.orchestrator.turns import Begun, Turn, TurnEngine, ended_error
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
_Queued = tuple[sbs.UpdateSubagentSessionRequest, "asyncio.Future[tp.SubagentSession]"]
_UNSET = (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING)


class RowWriter:
    """The changes of one batch's rows: one call in flight at a time, and whatever is asked for
    meanwhile goes in the next as one UpdateSubagentSessions (one transaction), so the rows of
    subagents that start or end together settle in a write or two. A call of several that fails is
    retried row by row: one row's failure stays its own."""

    def __init__(self, clients: Clients) -> None:
        self.clients = clients
        self._queue: list[_Queued] = []
        self._writer: asyncio.Task[None] | None = None

    async def update(self, request: sbs.UpdateSubagentSessionRequest) -> tp.SubagentSession:
        """The changed row (or the change's error); a caller cancelled meanwhile stops waiting, and the
        change is still written."""
        fut: asyncio.Future[tp.SubagentSession] = asyncio.get_running_loop().create_future()
        self._queue.append((request, fut))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write())
        return await asyncio.shield(fut)

    async def _write(self) -> None:
        batch: list[_Queued] = []
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                for (_, fut), result in zip(batch, await self._send([r for r, _ in batch]), strict=True):
                    if isinstance(result, BaseException):
                        fut.set_exception(result)
                    else:
                        fut.set_result(result)
        except BaseException as exc:  # never leave a caller waiting
            err = exc if isinstance(exc, Exception) else Cancelled("the write stopped")
            for _, fut in batch + self._queue:
                if not fut.done():
                    fut.set_exception(err)
            self._queue = []
            raise

    async def _send(
        self, requests: list[sbs.UpdateSubagentSessionRequest]
    ) -> list[tp.SubagentSession | MeshError]:
        trace = self.clients.subagents
        if len(requests) > 1:
            try:
                batch = sbs.UpdateSubagentSessionsRequest(updates=requests)
                return list((await rpc(trace.UpdateSubagentSessions(batch))).subagents)
            except MeshError:
                pass  # all or none: each on its own, so that only the failing row fails

        async def one(request: sbs.UpdateSubagentSessionRequest) -> tp.SubagentSession | MeshError:
            try:
                return (await rpc(trace.UpdateSubagentSession(request))).subagent
            except MeshError as err:
                return err

        return list(await asyncio.gather(*(one(r) for r in requests)))


def _user_text(task: orc.SubagentTask) -> str:
    return task.goal if not task.context else f"{task.goal}\n\nContext:\n{task.context}"


class SubagentBatch:
    """One delegate call: rows, buffers, concurrency, failure isolation, cancellation."""

    def __init__(
        self,
        engine: TurnEngine,
        kinds: Kinds,
        req: orc.RunSubagentsRequest,
        running: set[asyncio.Task[Any]] | None = None,
        max_background: int = 0,
    ) -> None:
        self.engine, self.kinds, self.req = engine, kinds, req
        self.max_background = max_background  # open background children per supervisor and trace
        self.running = running if running is not None else set()  # the process's work, for its drain
        self.clients = engine.clients
        self.writer = RowWriter(self.clients)
        self.rows: list[tp.SubagentSession] = []
        self.turns: list[Turn] = []
        self.begun: list[Begun] = []
        self._reports: asyncio.Queue[orc.RunSubagentsResponse | None] = asyncio.Queue()
        self._started: set[int] = set()  # rows whose turn went to the engine (it settles them)

    async def run(self) -> AsyncIterator[orc.RunSubagentsResponse]:
        req = self.req
        if not req.tasks or len(req.tasks) > MAX_DELEGATE_TASKS:
            raise InvalidArgument(f"give between 1 and {MAX_DELEGATE_TASKS} tasks")
        if req.background:
            await self._check_room()
        agents = await self._agents()
        await self._create(agents)
        # The rows have their runner before anyone hears of them: a caller gone at once leaves none
        # without one (each row's lease is held from its start).
        runner = asyncio.create_task(self._run_all(), name=f"subagents:{req.tool_call_id}")
        self.running.add(runner)
        runner.add_done_callback(self.running.discard)
        created = orc.RunSubagentsResponse(created=orc.SubagentRows(subagents=self.rows))
        if req.background:  # they run on without the call; the process's drain settles them
            yield created
            return
        try:
            yield created
            while (report := await self._reports.get()) is not None:
                yield report
            await runner
        finally:
            if not runner.done():  # the caller left: every row is settled before the call ends
                runner.cancel()
                await to_the_end(asyncio.gather(runner, return_exceptions=True))
        yield orc.RunSubagentsResponse(ended=orc.SubagentRows(subagents=self.rows))

    async def _check_room(self) -> None:
        """Refuses a background batch that would take its supervisor past the mesh's maximum of open
        background children in the trace (ResourceExhausted: nothing is created)."""
        req = self.req
        listed = await rpc(
            self.clients.subagents.ListSubagentSessions(
                sbs.ListSubagentSessionsRequest(trace_id=req.trace_id)
            )
        )
        running = sum(
            1
            for r in listed.subagents
            if r.background and r.status in _UNSET and r.parent_agent == req.parent_agent
        )
        if running + len(req.tasks) > self.max_background:
            raise ResourceExhausted(
                f"{req.parent_agent} has {running} background subagents running in this trace and may "
                f"have at most {self.max_background}: wait for one to end, or stop one"
            )

    async def _agents(self) -> dict[str, ap.Agent]:
        """Each agent of the batch, read once."""
        slugs = sorted({t.agent for t in self.req.tasks})
        found = await asyncio.gather(*(self.kinds.agent(slug) for slug in slugs))
        return dict(zip(slugs, found, strict=True))

    async def _create(self, agents: dict[str, ap.Agent]) -> None:
        """The rows with their turns' messages, then every buffer born with its turn's `start`. A batch
        whose buffers cannot be made settles every row before it fails."""
        req = self.req
        rows, messages = [], []
        for i, task in enumerate(req.tasks):
            agent = agents[task.agent]
            turn = Turn(
                trace_id="",
                agent=agent,
                input=_user_text(task),
                stream_key="",
                role=rt.RUN_ROLE_SUBAGENT,
                source=tp.MESSAGE_SOURCE_SUBAGENT,
                caller_agent=req.parent_agent,
                caller_trace_id=req.trace_id,
                depth=req.depth,
                limit_ms=task.limits.timeout_ms,  # (the agent's own limit is the Turn's too)
                overrides=task.overrides,
                fresh_key=True,
            )
            if not turn.overrides.model:
                turn.overrides.model = agent.model
            self.turns.append(turn)
            user, placeholder = turn.messages()
            messages.append(ms.TurnMessages(user_message=user, assistant_message=placeholder))
            rows.append(
                tp.SubagentSession(
                    trace_id=req.trace_id,
                    parent_message_id=req.anchor_message_id,
                    parent_tool_call_id=req.tool_call_id,
                    parent_agent=req.parent_agent,
                    source_type=task.source,
                    preset_agent=agent.slug if task.source == ev.SUBAGENT_SOURCE_PRESET else "",
                    name=task.name,
                    goal=task.goal,
                    context=task.context,
                    model=turn.overrides.model,
                    tool_names=list(task.overrides.tool_names.names),
                    sort_order=i,
                    batch_title=req.title,
                    background=req.background,
                )
            )
        created = await rpc(
            self.clients.subagents.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(subagents=rows, turns=messages)
            )
        )
        self.rows = list(created.subagents)
        starts = []
        for row, stored, turn in zip(self.rows, created.turns, self.turns, strict=True):
            turn.trace_id, turn.stream_key = row.child_trace_id, subagent_key(row.id)
            turn.stream_metadata = {
                "agent": turn.agent.slug,
                "kind": "subagent",
                "parentMessageId": str(req.anchor_message_id),
            }
            start = turn_start(
                turn.trace_id, stored.user_message.id, stored.assistant_message.id, turn.agent.slug
            )
            starts.append(start)
            self.begun.append(Begun(stored.user_message, stored.assistant_message, start))
        requests = [
            ss.CreateStreamRequest(key=t.stream_key, metadata=t.stream_metadata, events=[s])
            for t, s in zip(self.turns, starts, strict=True)
        ]
        try:
            made = await rpc(
                self.clients.stream.BatchCreateStreams(ss.BatchCreateStreamsRequest(requests=requests))
            )
        except BaseException as exc:  # no row ran, and none will: each ends here
            err = (
                self.engine.cancel_reason() if isinstance(exc, asyncio.CancelledError) else as_mesh_error(exc)
            )
            await to_the_end(asyncio.gather(*(self._settle_unbegun(i, err) for i in range(len(self.rows)))))
            raise
        for begun, answer in zip(self.begun, made.responses, strict=True):
            begun.start.offset = answer.offsets[0]

    async def _run_all(self) -> None:
        slots = asyncio.Semaphore(max(1, self.req.max_concurrent))
        tasks = [asyncio.create_task(self._one(i, slots)) for i in range(len(self.rows))]
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            for task in tasks:
                task.cancel()
            await to_the_end(asyncio.gather(*tasks, return_exceptions=True))  # every row settled first
            raise
        finally:
            self._reports.put_nowait(None)

    async def _one(self, i: int, slots: asyncio.Semaphore) -> None:
        turn, begun = self.turns[i], self.begun[i]
        leases = self.engine.leases
        try:
            # queued or running: the row, its buffer and its placeholder
            with leases.hold(subagent=self.rows[i].id, stream=turn.stream_key, message=begun.placeholder.id):
                if not await self._take_slot(i, slots):
                    return
                try:
                    await self._execute(i)
                finally:
                    slots.release()
        except asyncio.CancelledError:
            await to_the_end(self._settle_cancelled(i))
            raise
        except MeshError as err:
            if not self.req.background:
                raise
            # No caller to tell (its trace deleted meanwhile, say): the row's lease settles what is left.
            log.warning("a background subagent ended unsettled: %s", err, extra={"subagent": self.rows[i].id})

    async def _take_slot(self, i: int, slots: asyncio.Semaphore) -> bool:
        """Waits for a free slot; False when the row's buffer ended first (its turn was stopped while it
        waited `queued`): the row is then settled as that end says, and never runs."""
        if not slots.locked():
            await slots.acquire()
            return True
        acquire = asyncio.ensure_future(slots.acquire())
        stopped = asyncio.ensure_future(self._buffer_end(self.turns[i].stream_key))
        try:
            await asyncio.wait((acquire, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not acquire.done() and stopped.result() is None:
                await acquire  # the buffer could not be followed: the slot it is
        except BaseException:
            if acquire.done() and not acquire.cancelled():
                slots.release()
            acquire.cancel()
            raise
        finally:
            stopped.cancel()
        if acquire.done():
            return True
        acquire.cancel()
        err = stopped.result()
        assert err is not None
        await self._settle_unbegun(i, err)
        return False

    async def _buffer_end(self, key: str) -> MeshError | None:
        """The error `key` ends with (someone stopped the turn); None when it cannot be followed."""
        follow = self.clients.follows.follow(
            key, idle_timeout_ms=int(self.engine.write_timeout_s * 1000), terminal_only=True
        )
        try:
            async for event in follow:
                if event.HasField("error"):
                    return from_event(event.error)
                return Cancelled("the turn's buffer was ended before it ran")
        except MeshError:
            pass
        finally:
            follow.cancel()
        return None

    async def _execute(self, i: int) -> None:
        # The row turns running while the turn starts: its model request waits on no bookkeeping.
        running = asyncio.create_task(self._update(i, ["status"], status=ev.SUBAGENT_STATUS_RUNNING))
        self._started.add(i)
        try:
            ended = await self.engine.run(self.turns[i], self.begun[i])
        except BaseException:
            with contextlib.suppress(MeshError):
                await to_the_end(running)  # settled before the caller marks the row cancelled
            raise
        with contextlib.suppress(MeshError):
            await running
        err = ended_error(ended)
        if err is None:
            r = ended.result
            await self._update(
                i,
                ["status", "summary", "result_payload", "token_usage", "model"],
                status=ev.SUBAGENT_STATUS_COMPLETED,
                summary=r.content,
                result_payload={
                    "content": r.content,
                    "finishReason": enum_to_str(ev.FinishReason.DESCRIPTOR, r.finish_reason),
                },
                token_usage=r.usage,
                model=r.model,
            )
        else:
            status = ev.SUBAGENT_STATUS_CANCELLED if isinstance(err, Cancelled) else ev.SUBAGENT_STATUS_FAILED
            # What it streamed before it ended stays on the card (its placeholder keeps it too).
            await self._update(
                i,
                ["status", "error", "summary"],
                status=status,
                error=f"{err.code_name}: {err.message}",
                summary=ended.message.content,
            )

    async def _update(self, i: int, paths: list[str], **values: Any) -> None:
        row = tp.SubagentSession(id=self.rows[i].id)
        for key, value in values.items():
            if isinstance(value, ev.Usage):
                getattr(row, key).CopyFrom(value)
            elif key == "result_payload":
                row.result_payload.CopyFrom(events.struct(value))
            else:
                setattr(row, key, value)
        request = sbs.UpdateSubagentSessionRequest(
            subagent=row, update_mask=field_mask_pb2.FieldMask(paths=paths)
        )
        self.rows[i] = await self.writer.update(request)
        self._reports.put_nowait(orc.RunSubagentsResponse(changed=self.rows[i]))

    async def _settle_cancelled(self, i: int) -> None:
        """A row cancelled: one whose turn never started ends here; a started one the engine settled."""
        if i not in self._started:
            reason = self.engine.cancel_reason()
            await self._settle_unbegun(
                i, reason if not isinstance(reason, Cancelled) else Cancelled("cancelled before it ran")
            )
        elif self.rows[i].status in _UNSET:
            reason = self.engine.cancel_reason()  # a drain's cut is an interruption, not a cancel
            cancelled = isinstance(reason, Cancelled)
            status = ev.SUBAGENT_STATUS_CANCELLED if cancelled else ev.SUBAGENT_STATUS_FAILED
            error = "cancelled" if cancelled else f"{reason.code_name}: {reason.message}"
            with contextlib.suppress(MeshError):
                await self._update(i, ["status", "error"], status=status, error=error)

    async def _settle_unbegun(self, i: int, err: MeshError) -> None:
        """A row whose turn never ran ends with `err`: its placeholder and its buffer first, then the
        row (whoever reads the row ended finds them settled)."""
        cancelled = isinstance(err, Cancelled)
        message = tp.Message(
            id=self.begun[i].placeholder.id if i < len(self.begun) else 0,
            status=tp.MESSAGE_STATUS_CANCELLED if cancelled else tp.MESSAGE_STATUS_FAILED,
        )
        message.metadata.update({"error": {"code": err.code_name, "message": err.message}})
        if message.id:
            with contextlib.suppress(MeshError):
                await rpc(
                    self.clients.messages.UpdateMessage(
                        ms.UpdateMessageRequest(
                            message=message,
                            update_mask=field_mask_pb2.FieldMask(paths=["status", "metadata"]),
                        )
                    )
                )
            close = ss.CloseStreamRequest(key=self.turns[i].stream_key, error=err.to_event())
            with contextlib.suppress(Exception):
                await self.clients.stream.CloseStream(close, timeout=self.engine.grace_s)
        if self.rows[i].status in _UNSET:
            status = ev.SUBAGENT_STATUS_CANCELLED if cancelled else ev.SUBAGENT_STATUS_FAILED
            error = "cancelled" if cancelled else f"{err.code_name}: {err.message}"
            with contextlib.suppress(MeshError):
                await self._update(i, ["status", "error"], status=status, error=error)
