"""The turn engine: the one path every turn takes, whatever asked for it (docs/design/turns.md).

begin: the turn names its two messages (random ids) and its `start`; the buffer is created with
`start` as its first event and the user message and the placeholder (the anchor) are stored, at once
when the buffer's key is new, else the buffer first (it locks the trace against a second turn).
run: AgentRuntimeService.RunAgent (its events go straight into the buffer) -> the answer written back
onto the placeholder -> `finish` and `done` in one CloseStream. A new chat may start its run as soon
as its buffer exists, with the agent as last read (early.py).

Whatever fails after `begin`, the placeholder keeps what streamed (read back from the buffer), marked
failed or cancelled with `metadata.error`, and the buffer ends with an `error` event. The message
update and the close are attempted separately, so one failing never skips the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, telemetry
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import (
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Interrupted,
    MeshError,
    as_mesh_error,
    error_reason,
    from_event,
    from_rpc_error,
    rpc,
)
from agentmesh.libs.ids import new_id, new_message_id, trace_key
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import OrchestratorMetrics
from agentmesh.libs.turns import turn_messages, turn_start
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.orchestrator.early import EARLY_WHILE_BEGINNING, AgentChanged, verdict
from agentmesh.services.orchestrator.partial import Partial, ended_by, read_back
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

log = logging.getLogger(__name__)
RESULT_FIELDS = ["content", "thinking", "model", "usage", "metadata", "status"]
SETTLE_FIELDS = ["content", "thinking", "status", "metadata"]
RUN_GRACE_S = 0.5  # the run's call outlives the turn's limit by this: the runtime ends it at the limit


def limit(*limits: int) -> int:
    """The lowest limit that is set (0: none is)."""
    return min((x for x in limits if x > 0), default=0)


@dataclass
class Turn:
    """A turn as the engine runs it, resolved from its request by its kind (kinds.py)."""

    trace_id: str
    agent: ap.Agent
    input: str
    stream_key: str
    role: int = rt.RUN_ROLE_SUPERVISOR
    source: int = tp.MESSAGE_SOURCE_USER
    task_id: str = ""
    caller_agent: str = ""
    caller_trace_id: str = ""
    depth: int = 0
    limit_ms: int = 0  # the request's and the mesh's time limit, the lower (0: none)
    overrides: rt.RunOverrides = field(default_factory=rt.RunOverrides)
    parent_sequence: int | None = None  # the message it follows (0: a new root; None: the head)
    new_trace: tp.Trace | None = None  # created with the turn's messages
    fresh_key: bool = False  # its buffer's key is new: no other turn can hold it
    stream_metadata: dict[str, str] = field(default_factory=dict)
    remote_context_id: str = ""  # a remote agent's conversation to continue
    # A chat turn's agent, read while the turn begins (its rows and buffer name only its slug):
    # `agent` holds the slug alone until then.
    agent_read: Awaitable[ap.Agent] | None = None
    # A new chat's agent as last read here: its run may start once its buffer exists (early.py).
    last_read: ap.Agent | None = None

    @property
    def timeout_ms(self) -> int:
        """The turn's limit: the lowest of the request's, the mesh's and the agent's that is set."""
        return limit(self.limit_ms, self.agent.limits.timeout_ms)

    def again(self, agent: ap.Agent) -> None:
        """A new chat whose early run was dropped, made a new chat again: another trace, another
        buffer, and the agent as read (early.py)."""
        assert self.new_trace is not None
        self.trace_id = self.new_trace.id = new_id()
        self.stream_key = trace_key(self.trace_id)
        self.agent, self.last_read = agent, None

    def messages(self, user_id: int = 0, placeholder_id: int = 0) -> tuple[tp.Message, tp.Message]:
        """The turn's user message and placeholder, with their provenance."""
        return turn_messages(
            self.trace_id,
            self.input,
            source=self.source,
            a2a_task_id=self.task_id,
            caller_agent=self.caller_agent,
            caller_trace_id=self.caller_trace_id,
            model=self.overrides.model or self.agent.model,
            ids=(user_id, placeholder_id),
        )


@dataclass
class Begun:
    """A turn whose messages are stored and whose buffer holds its `start`."""

    user: tp.Message
    placeholder: tp.Message
    start: ev.Event  # with its offset
    run: grpc.aio.UnaryUnaryCall | None = None  # the early run's call, under way


class TurnEngine:
    def __init__(
        self,
        clients: Clients,
        leases: LeaseKeeper | None = None,
        metrics: OrchestratorMetrics | None = None,
        grace_s: float = 5.0,
    ) -> None:
        self.clients = clients
        self.leases = leases or LeaseKeeper(clients, lease_s=30.0)  # started by the process running it
        self.metrics = metrics or OrchestratorMetrics()
        self.grace_s = grace_s
        self.stopping = False  # the process stops: what it cancels now is interrupted, not cancelled
        self.beginning = 0  # turns in `begin`

    def cancel_reason(self) -> MeshError:
        """Why a turn this process cancelled ended: a caller up the tree cancelled it, or the process
        is stopping before it ended."""
        if self.stopping:
            return Interrupted("the orchestrator shut down before the turn ended")
        return Cancelled("the run was cancelled")

    @property
    def write_timeout_s(self) -> float:
        """The deadline of a turn's own writes: as long as the turn may take, so that a mesh saturated
        by a burst of turns starts them late, not never (a service that is gone fails them at once)."""
        return float(self.clients.settings.turn_timeout_s)

    # --- begin ------------------------------------------------------------------------------------

    async def begin(self, turn: Turn) -> Begun:
        """Stores the turn's messages and creates its buffer born with `start` (a new trace's agent is
        read meanwhile). A turn that does not begin leaves nothing open: a buffer it created ends with
        the error, a placeholder it stored is marked failed, a trace it created is deleted."""
        self.beginning += 1
        try:
            return await self._begin(turn)
        finally:
            self.beginning -= 1

    async def _begin(self, turn: Turn) -> Begun:
        last, turn.last_read = turn.last_read, None
        early = last is not None and self.beginning <= EARLY_WHILE_BEGINNING
        turn.agent = last if last is not None and early else turn.agent
        user, placeholder = turn.messages(new_message_id(), new_message_id())
        start = turn_start(turn.trace_id, user.id, placeholder.id, turn.agent.slug)
        create = ss.CreateStreamRequest(key=turn.stream_key, metadata=turn.stream_metadata, events=[start])
        store = ms.BeginTurnRequest(trace_id=turn.trace_id, user_message=user, assistant_message=placeholder)
        if turn.parent_sequence is not None:
            store.parent_sequence = turn.parent_sequence
        if turn.new_trace is not None:
            store.new_trace.CopyFrom(turn.new_trace)
        creating = rpc(self.clients.stream.CreateStream(create, timeout=self.write_timeout_s))
        reading, turn.agent_read = turn.agent_read, None
        runs: list[grpc.aio.UnaryUnaryCall] = []  # the early run's call, once its buffer exists
        if early:
            creating = self._then_run(creating, turn, placeholder.id, runs)

        def storing() -> Awaitable[ms.BeginTurnResponse]:  # (a gRPC call starts when it is made)
            return rpc(self.clients.messages.BeginTurn(store, timeout=self.write_timeout_s))

        created: ss.CreateStreamResponse | BaseException
        stored: ms.BeginTurnResponse | BaseException | None
        try:
            if turn.fresh_key:  # nothing to lock out: all at once
                created, stored, read = await asyncio.gather(
                    creating, storing(), reading or _nothing(), return_exceptions=True
                )
            else:  # the buffer first: it is the trace's lock against a second turn
                locked, read = await asyncio.gather(
                    _then(creating, storing), reading or _nothing(), return_exceptions=True
                )
                created, stored = locked if isinstance(locked, tuple) else (locked, None)
        except BaseException:
            _cancel(runs)
            raise
        failure = next((r for r in (read, created, stored) if isinstance(r, BaseException)), None)
        if early:
            failure, outcome = verdict(turn.agent, read, failure)
            self.metrics.early_runs.labels(outcome).inc()
        if failure is not None:
            _cancel(runs)
            err = (
                self.cancel_reason()
                if isinstance(failure, asyncio.CancelledError)
                else as_mesh_error(failure)
            )
            if not isinstance(created, BaseException):
                await to_the_end(self.close_buffer(turn.stream_key, events.error(err), created.offsets[0]))
            if isinstance(stored, ms.BeginTurnResponse):
                await to_the_end(self._undo(turn, stored, err))
            if isinstance(failure, AgentChanged) and isinstance(read, ap.Agent):
                turn.again(read)
            raise failure
        assert isinstance(created, ss.CreateStreamResponse) and isinstance(stored, ms.BeginTurnResponse)
        if isinstance(read, ap.Agent):
            turn.agent = read
        start.offset = created.offsets[0]
        return Begun(stored.user_message, stored.assistant_message, start, runs[0] if runs else None)

    async def _then_run(
        self,
        creating: Awaitable[ss.CreateStreamResponse],
        turn: Turn,
        placeholder_id: int,
        runs: list[grpc.aio.UnaryUnaryCall],
    ) -> ss.CreateStreamResponse:
        """The buffer, then the early run's call (a new trace: no history before its message)."""
        created = await creating
        runs.append(self._call_run(turn, placeholder_id, 0, created.offsets[0]))
        return created

    async def _undo(self, turn: Turn, stored: ms.BeginTurnResponse, err: MeshError) -> None:
        """What a turn that did not begin stored: the trace it created goes, else its placeholder
        is marked failed."""
        if turn.new_trace is None:
            await self.settle(stored.assistant_message.id, Partial(), err)
            return
        try:
            await self.clients.trace.DeleteTrace(
                ts.DeleteTraceRequest(trace_id=turn.trace_id), timeout=self.grace_s
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not delete the trace of a turn that did not begin: %s", exc.details())

    # --- run ----------------------------------------------------------------------------------------

    async def run(self, turn: Turn, begun: Begun) -> orc.TurnEnded:
        """Runs the agent and ends the turn: the answer stored and `finish`, `done` in the buffer, or
        the failure settled (a cancel of this task is settled, then raised). Someone else's end of the
        buffer (a cancel on any replica) stops the run and ends the turn as that end says."""
        started, outcome = time.monotonic(), "cancelled"
        with (
            telemetry.span(
                "turn", trace_id=turn.trace_id, agent=turn.agent.slug, stream_key=turn.stream_key
            ) as span,
            self.leases.hold(message=begun.placeholder.id),
        ):
            try:
                ended = await self._run(turn, begun)
                err = ended_error(ended)
                outcome = "ok" if err is None else err.code_name
                return ended
            except asyncio.CancelledError:
                await to_the_end(self._fail(turn, begun, self.cancel_reason()))
                raise
            finally:
                self.metrics.turns.labels(outcome).inc()
                if outcome != "ok":
                    telemetry.fail(span, outcome)
                log.info(
                    "turn ended",
                    extra={
                        "trace": turn.trace_id,
                        "agent": turn.agent.slug,
                        "outcome": outcome,
                        "duration_s": round(time.monotonic() - started, 3),
                    },
                )

    async def _run(self, turn: Turn, begun: Begun) -> orc.TurnEnded:
        call = begun.run or self._call_run(
            turn, begun.placeholder.id, begun.user.parent_sequence, begun.start.offset
        )
        ended_elsewhere = asyncio.Event()
        watcher = asyncio.create_task(
            self._watch(turn.stream_key, call, ended_elsewhere), name=f"watch:{turn.stream_key}"
        )
        try:
            result = (await call).result
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not ended_elsewhere.is_set() or (task is not None and task.cancelling()):
                raise
            # The watcher stopped the run: the turn ends as its buffer's end says.
            err = await ended_by(self.clients, turn.stream_key, self.grace_s)
            return await self._fail(turn, begun, err or Cancelled("the turn's buffer was ended elsewhere"))
        except grpc.aio.AioRpcError as exc:
            return await self._fail(turn, begun, await self._run_error(turn, begun, exc))
        except MeshError as err:
            return await self._fail(turn, begun, err)
        finally:
            call.cancel()
            watcher.cancel()
        try:
            message = await self._write_back(begun.placeholder.id, result)
        except MeshError as err:
            return await self._fail(turn, begun, err)
        try:
            end = await self._finish(turn, begun, result)
        except MeshError as err:  # the answer is stored: only the buffer is left to end
            return await self._fail(turn, begun, err, message)
        ended = orc.TurnEnded(message=message, result=result, end=end)
        ended.trace_ref = result.trace_ref or turn.trace_id
        return ended

    def _call_run(
        self, turn: Turn, placeholder_id: int, head_sequence: int, start_offset: str
    ) -> grpc.aio.UnaryUnaryCall:
        request = rt.RunAgentRequest(
            agent=turn.agent,
            role=turn.role,  # type: ignore[arg-type]
            trace_id=turn.trace_id,
            history_head_sequence=head_sequence,
            input=turn.input,
            anchor_message_id=placeholder_id,
            stream=rt.StreamRef(key=turn.stream_key, start_offset=start_offset),
            depth=turn.depth,
            overrides=turn.overrides,
            remote_context_id=turn.remote_context_id,
        )
        timeout = turn.timeout_ms / 1000 + RUN_GRACE_S if turn.timeout_ms else None
        return self.clients.runtime.RunAgent(request, timeout=timeout)

    async def _watch(self, key: str, call: grpc.aio.UnaryUnaryCall, ended: asyncio.Event) -> None:
        """Stops the run when someone else ends its buffer (a cancel or a delete on any replica)."""
        follow = self.clients.follows.follow(
            key, idle_timeout_ms=int(self.write_timeout_s * 1000), terminal_only=True
        )
        try:
            async for event in follow:
                if events.is_terminal(event):
                    ended.set()
                    call.cancel()
                    return
        except MeshError:
            return
        finally:
            follow.cancel()

    async def _run_error(self, turn: Turn, begun: Begun, exc: grpc.aio.AioRpcError) -> MeshError:
        """Why a run's call failed, as the turn ends."""
        if exc.code() == grpc.StatusCode.CANCELLED and (exc.details() or "CANCELLED") == "CANCELLED":
            # The runtime's side of the call was torn down (this turn was not cancelled)
            return Interrupted(f"the run of {turn.agent.slug} stopped before it ended")
        if (
            exc.code() == grpc.StatusCode.UNAVAILABLE
            and not error_reason(exc)  # the transport's, not the run's own (a remote agent gone)
            and await self._streamed(turn, begun)
        ):
            # The runtime went away under a run that had begun (it wrote past `start`): interrupted,
            # as a run whose process stopped is (docs/design/turns.md, "When a process dies").
            return Interrupted(f"the runtime running {turn.agent.slug} went away before the run ended")
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and turn.timeout_ms:
            return DeadlineExceeded(f"agent {turn.agent.slug} did not finish within {turn.timeout_ms} ms")
        return from_rpc_error(exc)

    async def _streamed(self, turn: Turn, begun: Begun) -> bool:
        """Whether the turn's run wrote anything into its buffer after `start`."""
        try:
            info = await self.clients.stream.GetStreamInfo(
                ss.GetStreamInfoRequest(key=turn.stream_key), timeout=self.grace_s
            )
        except grpc.aio.AioRpcError:
            return False
        return bool(info.exists and info.last_offset and info.last_offset != begun.start.offset)

    async def _write_back(self, placeholder_id: int, r: rt.RunResult) -> tp.Message:
        msg = tp.Message(
            id=placeholder_id,
            content=r.content,
            thinking=r.thinking,
            model=r.model,
            usage=r.usage,
            status=tp.MESSAGE_STATUS_COMPLETED,
        )
        msg.metadata.CopyFrom(r.metadata)
        request = ms.UpdateMessageRequest(
            message=msg, update_mask=field_mask_pb2.FieldMask(paths=RESULT_FIELDS)
        )
        return (await rpc(self.clients.messages.UpdateMessage(request, timeout=self.write_timeout_s))).message

    async def _finish(self, turn: Turn, begun: Begun, r: rt.RunResult) -> ev.Event:
        """`finish`, then `done`: one CloseStream to the turn's buffer. Raises as an append does (a
        buffer closed meanwhile: FailedPrecondition; replaced: Interrupted)."""
        finish = ev.Event(finish=ev.TurnFinish(finish_reason=r.finish_reason, usage=r.usage, model=r.model))
        request = ss.CloseStreamRequest(
            key=turn.stream_key, events=[finish], done=ev.StreamDone(), since=begun.start.offset
        )
        resp = await rpc(self.clients.stream.CloseStream(request, timeout=self.write_timeout_s))
        return ev.Event(done=ev.StreamDone(), offset=resp.offset)

    # --- failure ------------------------------------------------------------------------------------

    async def _fail(
        self, turn: Turn, begun: Begun, err: MeshError, stored: tp.Message | None = None
    ) -> orc.TurnEnded:
        """Settles a failed turn: the placeholder keeps what streamed, marked failed or cancelled
        (unless its answer was `stored` already), and the buffer ends with the error. A buffer someone
        else ended (FailedPrecondition on a write) makes the turn end as that end says."""
        if isinstance(err, FailedPrecondition):
            err = await ended_by(self.clients, turn.stream_key, self.grace_s) or err
        log.info("turn failed", extra={"trace": turn.trace_id, "code": err.code_name, "error": err.message})
        ended = orc.TurnEnded(error=err.to_event(), trace_ref=turn.trace_id)
        message = stored
        if message is None:
            partial = await read_back(self.clients, turn.stream_key, begun.start.offset, self.grace_s)
            model = turn.overrides.model or turn.agent.model
            message = await self.settle(begun.placeholder.id, partial, err, model)
        if message is not None:
            ended.message.CopyFrom(message)
        ended.end.CopyFrom(await self.close_buffer(turn.stream_key, events.error(err), begun.start.offset))
        return ended

    async def settle(
        self, placeholder_id: int, partial: Partial, err: MeshError, model: str = ""
    ) -> tp.Message | None:
        """The placeholder of a failed turn: what streamed, marked failed or cancelled (with the model
        the turn ran, when known: a new trace's placeholder is stored before its agent is read)."""
        status = tp.MESSAGE_STATUS_CANCELLED if isinstance(err, Cancelled) else tp.MESSAGE_STATUS_FAILED
        message = partial.message(placeholder_id, status, err)
        paths = list(SETTLE_FIELDS)
        if model:
            message.model = model
            paths.append("model")
        request = ms.UpdateMessageRequest(message=message, update_mask=field_mask_pb2.FieldMask(paths=paths))
        try:
            return (await self.clients.messages.UpdateMessage(request, timeout=self.grace_s)).message
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "could not settle the placeholder of a failed turn: %s",
                exc.details(),
                extra={"message_id": placeholder_id},
            )
            return None

    async def close_buffer(self, key: str, outcome: ev.Event, since: str) -> ev.Event:
        """Ends the buffer `since` names with `outcome`; returns the buffer's terminal event (the earlier
        one when someone ended it first), or `outcome` without an offset when the stream service
        cannot be reached."""
        request = ss.CloseStreamRequest(key=key, error=outcome.error, since=since)
        try:
            resp = await self.clients.stream.CloseStream(request, timeout=self.grace_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not close %s: %s", key, exc.details(), extra={"key": key})
            return outcome
        if resp.closed:
            outcome.offset = resp.offset
            return outcome
        with contextlib.suppress(MeshError):
            earlier = await ended_by(self.clients, key, self.grace_s)
            if earlier is not None:
                return ev.Event(error=earlier.to_event(), offset=resp.offset)
        return ev.Event(done=ev.StreamDone(), offset=resp.offset)


async def _nothing() -> None:
    return None


def _cancel(calls: list[grpc.aio.UnaryUnaryCall]) -> None:
    for call in calls:
        call.cancel()


async def _then(
    creating: Awaitable[ss.CreateStreamResponse], storing: Callable[[], Awaitable[ms.BeginTurnResponse]]
) -> tuple[ss.CreateStreamResponse, ms.BeginTurnResponse | BaseException]:
    """The buffer, then the rows (or why they were not stored): the rows never come without it."""
    created = await creating
    try:
        return created, await storing()
    except (MeshError, asyncio.CancelledError) as exc:
        return created, exc


def ended_error(ended: orc.TurnEnded) -> MeshError | None:
    """The error a turn ended with, or None when it completed."""
    return from_event(ended.error) if ended.HasField("error") else None
