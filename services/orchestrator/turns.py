"""The turn engine: one turn in one trace, the same for a chat turn, an agent-invoke callee and a
subagent (docs/requirements.md#stable-anchor; docs/requirements.md#invoke-message-provenance).

create the live buffer -> save the user message -> pre-create the assistant placeholder (the
anchor) -> `start` -> AgentRuntimeService.RunAgent streams the run (its events are already in the
buffer) -> write content, thinking, model, usage and metadata back onto the placeholder -> `finish`
and `done` (one CloseStream call).

Whatever fails, the buffer ends: the placeholder keeps what was streamed (text, reasoning, tool
calls) marked failed or cancelled with `metadata.error`, and the buffer closes with an `error` event.
The message update and the close are attempted separately, so one failing never skips the other;
when the stream service itself is gone, the direct caller still gets the `error` event.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
    Internal,
    Interrupted,
    MeshError,
    as_mesh_error,
    from_event,
    from_rpc_error,
    rpc,
)
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import OrchestratorMetrics
from agentmesh.libs.protojson import to_json
from agentmesh.libs.turns import turn_messages, turn_start
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

log = logging.getLogger(__name__)
OnEvent = Callable[[ev.Event], Awaitable[None] | None]
RESULT_FIELDS = ["content", "thinking", "model", "usage", "metadata", "status"]


@dataclass
class TurnOutcome:
    user_message: tp.Message | None = None
    assistant_message: tp.Message | None = None
    result: rt.RunResult | None = None
    error: MeshError | None = None
    written: bool = False  # the result is stored on the placeholder
    start_offset: str = ""  # of `start` in the turn's buffer

    @property
    def ok(self) -> bool:
        return self.error is None and self.result is not None


@dataclass
class Partial:
    """What a run has streamed so far, kept so a failed or cancelled turn loses none of it."""

    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    step: int = 0
    _after_output: bool = False
    seen: bool = False  # it saw the run's events live (else they are read back from the buffer)

    def see(self, event: ev.Event) -> None:
        self.seen = True
        which = events.kind(event)
        if which == "text_delta":
            self.text.append(event.text_delta.text_delta)
        elif which == "reasoning_delta":
            self.thinking.append(event.reasoning_delta.reasoning_delta)
        elif which == "tool_input_available":
            if self._after_output:  # the first call of the next model step
                self.step += 1
                self._after_output = False
            data = to_json(event.tool_input_available)
            self.calls[data["toolCallId"]] = {
                "id": data["toolCallId"],
                "name": data["toolName"],
                "input": data.get("input"),
                "output": {"ok": False, "error": "the turn ended before the tool did"},
                "ok": False,
                "step": self.step,
            }
        elif which == "tool_output_available":
            data = to_json(event.tool_output_available)
            call = self.calls.get(data["toolCallId"])
            if call is not None:
                call.update(output=data.get("output"), ok=data["ok"], metadata=data.get("metadata", {}))
            self._after_output = True

    def message(self, message_id: int, status: int, err: MeshError) -> tp.Message:
        msg = tp.Message(
            id=message_id,
            content="".join(self.text),
            thinking="".join(self.thinking),
            status=status,  # type: ignore[arg-type]
        )
        metadata: dict[str, Any] = {"error": {"code": err.code_name, "message": err.message}}
        if self.calls:
            metadata["toolCalls"] = list(self.calls.values())
        msg.metadata.update(metadata)
        return msg


class TurnEngine:
    def __init__(
        self,
        clients: Clients,
        leases: LeaseKeeper | None = None,
        grace_s: float = 5.0,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.clients = clients
        self.leases = leases or LeaseKeeper(clients, lease_s=30.0)  # started by the process that runs it
        self.grace_s = grace_s
        self.metrics = metrics or OrchestratorMetrics()

    @property
    def write_timeout_s(self) -> float:
        """The deadline of a turn's own writes (its set-up, its write-back and its close): as long as
        the turn may take, so that a mesh saturated by a burst of turns starts them late, not never
        (a service that is gone fails them at once all the same)."""
        return float(self.clients.settings.turn_timeout_s)

    async def _append(self, key: str, event: ev.Event, on_event: OnEvent | None) -> None:
        request = ss.AppendEventsRequest(key=key, events=[event])
        resp = await rpc(self.clients.stream.AppendEvents(request, timeout=self.write_timeout_s))
        event.offset = resp.offsets[0]
        await _deliver(on_event, event)

    async def _close(self, key: str, outcome: ev.Event, on_event: OnEvent | None, since: str = "") -> None:
        """Ends the buffer with `outcome` and delivers it; delivered without an offset when the stream
        service cannot be reached (the caller must still learn how the turn ended). `since`: an offset
        of the buffer meant (a newer buffer of the key is another turn's, and stays as it is)."""
        req = ss.CloseStreamRequest(key=key, since=since)
        if outcome.HasField("error"):
            req.error.CopyFrom(outcome.error)
        else:
            req.done.CopyFrom(ev.StreamDone())
        try:
            resp = await self.clients.stream.CloseStream(req, timeout=self.grace_s)
        except grpc.aio.AioRpcError as exc:
            log.warning("could not close %s: %s", key, exc.details(), extra={"key": key})
            if outcome.HasField("error"):
                await _deliver(on_event, outcome)
            else:
                await _deliver(on_event, events.error(from_rpc_error(exc)))
            return
        if resp.closed:
            outcome.offset = resp.offset
            await _deliver(on_event, outcome)

    async def _finish(self, key: str, finish: ev.Event, on_event: OnEvent | None, since: str) -> None:
        """`finish`, then `done`: one CloseStream to the buffer `since` is an offset of. Raises as an
        append does (a buffer closed meanwhile: FailedPrecondition; gone: Interrupted), so that the
        turn's failure path ends the buffer with the error."""
        request = ss.CloseStreamRequest(key=key, events=[finish], done=ev.StreamDone(), since=since)
        resp = await rpc(self.clients.stream.CloseStream(request, timeout=self.write_timeout_s))
        finish.offset = resp.offsets[0]
        await _deliver(on_event, finish)
        if resp.closed:  # else someone ended it between the two (a cancel): theirs is the end
            await _deliver(on_event, ev.Event(done=ev.StreamDone(), offset=resp.offset))

    @staticmethod
    def _messages(spec: orc.RunTurnRequest) -> tuple[tp.Message, tp.Message]:
        """The turn's user message and placeholder, as BeginTurn stores them (the user message: an
        early run's whole history)."""
        return turn_messages(
            spec.trace_id,
            spec.user_text,
            source=spec.source,
            a2a_task_id=spec.a2a_task_id,
            caller_agent=spec.caller_agent,
            caller_session_id=spec.caller_session_id,
            model=spec.overrides.model,
        )

    async def run(
        self,
        spec: orc.RunTurnRequest,
        on_event: OnEvent | None = None,
        new_trace: tp.Trace | None = None,
        run_events: bool = True,
        agent: ap.Agent | None = None,
        buffer: Awaitable[Any] | None = None,
        early: grpc.aio.UnaryStreamCall | None = None,
        begun: Awaitable[ms.BeginTurnResponse] | None = None,
    ) -> TurnOutcome:
        """Runs the turn; returns its outcome (failures are in `outcome.error`); re-raises cancellation.

        Errors before the user message is saved (an unknown trace, a turn already streaming) raise,
        and the buffer is closed with them when this turn created it. While it runs, the turn keeps the
        leases of its buffer and of its placeholder alive (so if this process dies, a reaper settles
        them). `new_trace`: the trace `spec.trace_id` does not exist yet; it is created with the turn's
        first messages, in the same call. `run_events=False`: `on_event` gets the turn's own events
        (start, finish, the end), not the run's: the runtime sends its result alone, and the run's
        events are read back from the buffer only when a failed turn must keep what was streamed.
        `agent`: the agent as the caller just read it, handed to the run (which would read it again).
        `buffer`: the CreateStream of a new trace's buffer, which the caller started (beside reading
        the agent). `early`: the run of a new trace, which the caller started (`start_early`) with
        `agent` before it had read it (the agent as it was last read, confirmed since); `begun`: the
        BeginTurn of that new trace, which the caller sent then too (`begin_early`)."""
        outcome = "cancelled"
        started = time.monotonic()
        with telemetry.span(
            "turn", trace_id=spec.trace_id, agent=spec.agent, stream_key=spec.stream_key, depth=spec.depth
        ) as span:
            try:
                with self.leases.hold(stream=spec.stream_key):
                    out = await self._run(spec, on_event, new_trace, run_events, agent, buffer, early, begun)
                outcome = out.error.code_name if out.error is not None else "ok"
                return out
            except MeshError as err:
                outcome = err.code_name
                raise
            finally:
                self.metrics.turns.labels(outcome).inc()
                if outcome != "ok":
                    telemetry.fail(span, outcome)
                log.info(
                    "turn ended",
                    extra={
                        "trace": spec.trace_id,
                        "agent": spec.agent,
                        "outcome": outcome,
                        "duration_s": round(time.monotonic() - started, 3),
                    },
                )

    async def _run(
        self,
        spec: orc.RunTurnRequest,
        on_event: OnEvent | None,
        new_trace: tp.Trace | None,
        run_events: bool,
        agent: ap.Agent | None,
        buffer: Awaitable[Any] | None = None,
        started: grpc.aio.UnaryStreamCall | None = None,
        begun: Awaitable[ms.BeginTurnResponse] | None = None,
    ) -> TurnOutcome:
        out = TurnOutcome()
        partial = Partial()
        begin = self.begin_request(spec, new_trace)
        if spec.HasField("begun"):  # stored by the caller, with `start` in its buffer already
            begun = asyncio.get_running_loop().create_future()
            begun.set_result(
                ms.BeginTurnResponse(
                    user_message=spec.begun.user_message, assistant_message=spec.begun.assistant_message
                )
            )
        create: Awaitable[Any] | None = None
        early: list[grpc.aio.UnaryStreamCall] = []  # the run of a new trace, started before BeginTurn ends
        if buffer is None and not spec.stream_created:
            buffer = self.create_buffer(spec.stream_key, spec.stream_metadata)
        if buffer is not None:
            if new_trace is None:  # the buffer first: it is the session's lock against a second turn
                await buffer
            else:  # a new trace has no turn to lock out: BeginTurn goes on while its buffer is created
                create = buffer
                if started is not None:  # its run, which the caller started
                    early.append(started)
                elif agent is not None:  # its run, started now: the stream service waits for the buffer
                    early.append(self._call_early(spec, begin.user_message, run_events, agent))
        elif spec.empty_trace and agent is not None:
            # A child's new hidden trace, its buffer made by the caller: the run starts at once, as a
            # new trace's does, and calls the model while BeginTurn stores the messages.
            early.append(self._call_early(spec, begin.user_message, run_events, agent))
        if agent is None and begun is None:  # the agent is read by BeginTurn, in the same call
            begin.resolve_agent = spec.agent
        try:
            stored = await self._begin(
                spec,
                begun or rpc(self.clients.messages.BeginTurn(begin, timeout=self.write_timeout_s)),
                create,
                out,
                partial,
            )
            user, placeholder = stored.user_message, stored.assistant_message
            if agent is None and stored.HasField("agent"):
                agent = stored.agent
            out.user_message, out.assistant_message = user, placeholder
            try:
                with self.leases.hold(message=placeholder.id):
                    empty = new_trace is not None or spec.empty_trace
                    request = self._run_request(spec, user, placeholder, run_events, agent, empty)
                    call = early[0] if early else None
                    await self._stream_turn(
                        spec, user, placeholder, on_event, partial, out, request, call, stored
                    )
            except asyncio.CancelledError as exc:
                await to_the_end(self._fail(spec, out, cancel_reason(exc), on_event, partial))
                raise
            except (grpc.aio.AioRpcError, MeshError) as exc:
                await to_the_end(self._fail(spec, out, as_mesh_error(exc), on_event, partial))
            return out
        finally:
            for call in early:
                call.cancel()  # a turn that failed to begin stops its run (once over, a no-op)

    def create_buffer(self, key: str, metadata: Mapping[str, str]) -> asyncio.Future[Any]:
        """The CreateStream of a turn's buffer, under way from now."""
        request = ss.CreateStreamRequest(key=key, metadata=dict(metadata))
        return asyncio.ensure_future(
            rpc(self.clients.stream.CreateStream(request, timeout=self.write_timeout_s))
        )

    async def end_unused(self, created: Awaitable[Any], key: str, why: BaseException) -> None:
        """The buffer of a turn that never began (`created`: its CreateStream) ends with `why`; nobody
        reads it, and it expires like any closed buffer."""
        try:
            await created
        except Exception:
            return  # never made: nothing to end
        err = cancel_reason(why) if isinstance(why, asyncio.CancelledError) else as_mesh_error(why)
        await self._close(key, events.error(err), None)

    def begin_request(self, spec: orc.RunTurnRequest, new_trace: tp.Trace | None) -> ms.BeginTurnRequest:
        """The user message and the placeholder (and a new trace): one call, all stored or none; the
        trace service appends the turn's `start` to its buffer then (unless the caller did: `begun`)."""
        user, placeholder = self._messages(spec)
        begin = ms.BeginTurnRequest(trace_id=spec.trace_id, user_message=user, assistant_message=placeholder)
        if new_trace is not None:
            begin.new_trace.CopyFrom(new_trace)
        if not spec.HasField("begun"):
            begin.start_key = spec.stream_key
            begin.start.CopyFrom(turn_start(spec.trace_id, 0, 0, spec.agent).start)
        return begin

    def begin_early(
        self, spec: orc.RunTurnRequest, new_trace: tp.Trace, resolve_agent: str, last: ap.Agent
    ) -> asyncio.Future[ms.BeginTurnResponse]:
        """The BeginTurn of a new trace, sent now (what `run(..., begun=)` takes), reading the agent
        `resolve_agent` too: its `start` goes in the buffer only when that read is `last` (as the
        caller last read it). One no turn takes is the caller's to undo (`drop_begun`)."""
        request = self.begin_request(spec, new_trace)
        request.resolve_agent = resolve_agent
        request.start_if_agent.CopyFrom(last)
        return asyncio.ensure_future(
            rpc(self.clients.messages.BeginTurn(request, timeout=self.write_timeout_s))
        )

    async def drop_begun(self, begun: Awaitable[ms.BeginTurnResponse], trace_id: str) -> None:
        """Undoes a `begin_early` no turn takes: the trace it stored, if it did, is deleted."""
        try:
            await begun
        except Exception:
            return  # nothing stored
        try:
            await self.clients.trace.DeleteTrace(
                ts.DeleteTraceRequest(trace_id=trace_id), timeout=self.grace_s
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("could not delete an unused trace: %s", exc.details(), extra={"trace": trace_id})

    async def _begin(
        self,
        spec: orc.RunTurnRequest,
        begin: Awaitable[ms.BeginTurnResponse],
        create: Awaitable[Any] | None,
        out: TurnOutcome,
        partial: Partial,
    ) -> ms.BeginTurnResponse:
        """`begin` (the BeginTurn call), beside `create` (the buffer's creation) when given; the
        messages are on `out` once stored. A turn that fails to begin ends its buffer with the error."""
        try:
            if create is None:
                return await begin
            results = await asyncio.gather(begin, create, return_exceptions=True)
            begun = results[0]
            if isinstance(begun, ms.BeginTurnResponse):
                out.user_message, out.assistant_message = begun.user_message, begun.assistant_message
            for result in results:
                if isinstance(result, BaseException):
                    raise result
            assert isinstance(begun, ms.BeginTurnResponse)
            return begun
        except MeshError as err:
            await to_the_end(self._fail(spec, out, err, None, partial))  # never leave the buffer open
            raise
        except asyncio.CancelledError as exc:
            await to_the_end(self._fail(spec, out, cancel_reason(exc), None, partial))
            raise

    def start_early(
        self, spec: orc.RunTurnRequest, run_events: bool, agent: ap.Agent
    ) -> grpc.aio.UnaryStreamCall:
        """The run of a new trace `spec.trace_id`, started now (beside its buffer's creation: the stream
        service waits for the buffer): what `run(..., early=)` takes. A run no turn takes is the
        caller's to cancel."""
        return self._call_early(spec, self._messages(spec)[0], run_events, agent)

    def _call_early(
        self, spec: orc.RunTurnRequest, user: tp.Message, run_events: bool, agent: ap.Agent
    ) -> grpc.aio.UnaryStreamCall:
        """Starts the run of an empty trace before its messages are stored (its history is the user
        message, its agent was read): it stores nothing until `start` is in the buffer
        (RunAgentRequest.await_start)."""
        request = self._run_request(spec, user, tp.Message(), run_events, agent, True)
        request.await_start = True
        return self._call_run(spec, request)

    async def _stream_turn(
        self,
        spec: orc.RunTurnRequest,
        user: tp.Message,
        placeholder: tp.Message,
        on_event: OnEvent | None,
        partial: Partial,
        out: TurnOutcome,
        request: rt.RunAgentRequest,
        call: grpc.aio.UnaryStreamCall | None,
        stored: ms.BeginTurnResponse,
    ) -> None:
        """start (unless the caller put it in the buffer: `spec.begun`; appended by BeginTurn when
        `stored` says so) -> the run (`call`: already started, awaiting `start`) -> the write-back ->
        finish and done in one call (a reader that sees the end finds the reply stored)."""
        if stored.HasField("start_error"):  # BeginTurn's append may have stored it: no second one
            raise from_event(stored.start_error)
        if not spec.HasField("begun"):
            start = turn_start(spec.trace_id, user.id, placeholder.id, spec.agent)
            if stored.start_offset:
                start.offset = stored.start_offset
                await _deliver(on_event, start)
            else:
                await self._append(spec.stream_key, start, on_event)
            out.start_offset = start.offset
        if call is None:  # its writes name the turn's buffer (a run started early learns it from `start`)
            request.start_offset = out.start_offset
        out.result = await self._run_agent(spec, request, on_event, partial, call)
        await self._write_back(out)
        finish = ev.Event(
            finish=ev.TurnFinish(
                finish_reason=out.result.finish_reason, usage=out.result.usage, model=out.result.model
            )
        )
        await self._finish(spec.stream_key, finish, on_event, out.start_offset)

    @staticmethod
    def _run_request(
        spec: orc.RunTurnRequest,
        user: tp.Message,
        anchor: tp.Message,
        run_events: bool,
        agent: ap.Agent | None,
        empty_trace: bool,
    ) -> rt.RunAgentRequest:
        request = rt.RunAgentRequest(
            agent=spec.agent,
            role=spec.role,
            trace_id=spec.trace_id,
            history_head_sequence=user.sequence,
            anchor_message_id=anchor.id,
            stream_key=spec.stream_key,
            depth=spec.depth,
            timeout_ms=spec.timeout_ms,
            overrides=spec.overrides,
            result_only=not run_events,
        )
        if agent is not None:
            request.resolved_agent.CopyFrom(agent)
        if empty_trace:  # its whole history is the user message just stored: the run need not read it
            request.history.append(user)
            request.history_given = True
        return request

    async def _run_agent(
        self,
        spec: orc.RunTurnRequest,
        request: rt.RunAgentRequest,
        on_event: OnEvent | None,
        partial: Partial,
        call: grpc.aio.UnaryStreamCall | None = None,
    ) -> rt.RunResult:
        call = call or self._call_run(spec, request)
        result: rt.RunResult | None = None
        try:
            async for resp in call:
                if resp.HasField("events"):
                    for event in resp.events.events:
                        partial.see(event)
                        await _deliver(on_event, event)
                else:
                    result = resp.result
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            if exc.code() == grpc.StatusCode.CANCELLED and (exc.details() or "CANCELLED") == "CANCELLED":
                # The runtime's side of the call was torn down (this turn was not cancelled: that would
                # raise CancelledError here): the turn ends `interrupted`, never `cancelled`.
                err = Interrupted(f"the run of {spec.agent} stopped before it ended")
            if (
                exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                and spec.timeout_ms
                and not isinstance(err, DeadlineExceeded)
            ):
                err = DeadlineExceeded(f"agent {spec.agent} did not finish within {spec.timeout_ms} ms")
            raise err from exc
        finally:
            call.cancel()
        if result is None:
            raise Internal(f"agent {spec.agent} ended without a result")
        return result

    def _call_run(self, spec: orc.RunTurnRequest, request: rt.RunAgentRequest) -> grpc.aio.UnaryStreamCall:
        deadline = (spec.timeout_ms / 1000 + self.grace_s) if spec.timeout_ms else None
        return self.clients.runtime.RunAgent(request, timeout=deadline)

    async def _write_back(self, out: TurnOutcome) -> None:
        assert out.assistant_message is not None and out.result is not None
        r = out.result
        msg = tp.Message(
            id=out.assistant_message.id,
            content=r.content,
            thinking=r.thinking,
            model=r.model,
            usage=r.usage,
            status=tp.MESSAGE_STATUS_COMPLETED,
        )
        msg.metadata.CopyFrom(r.metadata)
        resp = await rpc(
            self.clients.messages.UpdateMessage(
                ms.UpdateMessageRequest(
                    message=msg, update_mask=field_mask_pb2.FieldMask(paths=RESULT_FIELDS)
                ),
                timeout=self.write_timeout_s,
            )
        )
        out.assistant_message = resp.message
        out.written = True

    async def _fail(
        self,
        spec: orc.RunTurnRequest,
        out: TurnOutcome,
        err: MeshError,
        on_event: OnEvent | None,
        partial: Partial,
    ) -> None:
        """Settles a failed turn: the placeholder keeps what was streamed, marked failed or cancelled
        (unless its result was already stored), and the buffer ends with the error. Each step is
        tried on its own and bounded by the grace; a failing step is logged, never raised. A write
        the buffer refused (FailedPrecondition: someone else ended it, a cancel from another replica
        or a lease that ran out) fails the turn as that end said, whether or not its watcher saw it."""
        if isinstance(err, FailedPrecondition):
            err = await self._ended_by(spec.stream_key) or err
        out.error = err
        log.info("turn failed", extra={"trace": spec.trace_id, "code": err.code_name, "error": err.message})
        if out.assistant_message is not None and not out.written:
            if not partial.seen and out.start_offset:
                partial = await self._read_back(spec.stream_key, out.start_offset)
            cancelled = isinstance(err, Cancelled)
            status = tp.MESSAGE_STATUS_CANCELLED if cancelled else tp.MESSAGE_STATUS_FAILED
            msg = partial.message(out.assistant_message.id, status, err)
            try:
                resp = await self.clients.messages.UpdateMessage(
                    ms.UpdateMessageRequest(
                        message=msg,
                        update_mask=field_mask_pb2.FieldMask(
                            paths=["content", "thinking", "status", "metadata"]
                        ),
                    ),
                    timeout=self.grace_s,
                )
                out.assistant_message = resp.message
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "could not settle the placeholder of a failed turn: %s",
                    exc.details(),
                    extra={"trace": spec.trace_id, "message_id": out.assistant_message.id},
                )
        await self._close(spec.stream_key, events.error(err), on_event, out.start_offset)

    async def _ended_by(self, key: str) -> MeshError | None:
        """The error `key` was ended with, read from the buffer; None when it did not end with one
        (still open after READ_BACK_IDLE_MS, ended `done`, or unreadable)."""
        follow = self.clients.follows.follow(key, "", READ_BACK_IDLE_MS, terminal_only=True)
        try:
            async with asyncio.timeout(self.grace_s):
                async for event in follow:
                    return from_event(event.error) if event.HasField("error") else None
        except (MeshError, TimeoutError):
            pass
        finally:
            follow.cancel()
        return None

    async def _read_back(self, key: str, after: str) -> Partial:
        """What the run streamed into `key` after `after`, read back from the buffer (replayed to its
        end: the follow stops at the terminal event, or once nothing more comes for a moment)."""
        partial = Partial()
        follow = self.clients.follows.follow(key, after, READ_BACK_IDLE_MS)
        try:
            async with asyncio.timeout(self.grace_s):
                async for event in follow:
                    if events.kind(event) in events.TERMINAL:
                        break
                    partial.see(event)
        except (MeshError, TimeoutError) as exc:
            log.warning("could not read back what %s streamed: %s", key, exc, extra={"key": key})
        finally:
            follow.cancel()
        return partial


READ_BACK_IDLE_MS = 200


SHUTDOWN = "shutdown"  # the cancel message of a turn its process stops before it ends


def cancel_reason(exc: asyncio.CancelledError) -> MeshError:
    """A turn cancelled by a user (or a caller up the tree), or cut short by its process's shutdown."""
    if SHUTDOWN in exc.args:
        return Interrupted("the orchestrator shut down before the turn ended")
    return Cancelled("the run was cancelled")


async def _deliver(fn: OnEvent | None, event: ev.Event) -> None:
    if fn is None:
        return
    result = fn(event)
    if result is not None:
        await result
