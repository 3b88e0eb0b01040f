"""ChatOrchestrator: one chat turn, the single entry behind both HTTP and WebSocket
(docs/requirements.md#one-orchestration-layer).

The turn runs as its own task: a caller that goes away stops reading, the turn goes on and can be
resumed from session:<id>. A cancellation (CancelChat on any replica) closes session:<id> with an
`error` event whose code is `cancelled`; the replica running the turn watches its buffer and
cancels the run, which cancels its children over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.aio import to_the_end
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import Cancelled, Internal, InvalidArgument, MeshError, from_rpc_error, rpc
from agentmesh.libs.ids import a2a_key, is_local_id, new_id, session_key, subagent_key
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.metrics import OrchestratorMetrics
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.orchestrator.turns import SHUTDOWN, TurnEngine, TurnOutcome, cancel_reason
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts

log = logging.getLogger(__name__)
MAX_MESSAGE_CHARS = 100_000


def _refuse_copies(session: tp.Trace) -> None:
    """Our cached copy of a peer's trace takes no turn: it would fork the peer's trace."""
    if session.home:
        raise InvalidArgument(
            f"{session.home} lives on a peer: continue it there, or with agent-invoke continueFrom"
        )


@dataclass
class _End:
    error: BaseException | None = None


class _Opening(NamedTuple):
    """A new session's first turn, under way while its agent is read."""

    session: tp.Trace
    agent: str  # the slug asked for
    message: str
    last: ap.Agent | None  # the agent as this user last read it, if they did
    buffer: asyncio.Future[Any]  # its CreateStream
    early: grpc.aio.UnaryStreamCall | None  # its run, started with `last`
    begun: asyncio.Future[ms.BeginTurnResponse] | None  # its BeginTurn with `last`, reading the agent
    reading: asyncio.Future[Any]  # `begun`, or else a GetAgent


class _Opened(NamedTuple):
    """A new session about to take its first turn."""

    session: tp.Trace
    agent: ap.Agent
    trace: tp.Trace  # the row BeginTurn creates
    buffer: asyncio.Future[Any]  # its CreateStream
    early: grpc.aio.UnaryStreamCall | None  # its run, started with the agent as last read
    begun: asyncio.Future[ms.BeginTurnResponse] | None  # its BeginTurn, sent then too


@dataclass
class _Created:
    """The turn's buffer exists (said to a caller that reads the events from it)."""

    session_id: str


def _stream_metadata(agent: str) -> dict[str, str]:
    """What a chat turn's buffer says of itself."""
    return {"agent": agent, "kind": "chat"}


def _new_trace(agent: str, message: str) -> tp.Trace:
    """The row of a new chat session whose first message is `message`."""
    return tp.Trace(agent=agent, kind=tp.TRACE_KIND_CHAT, title=message.strip()[:80])


def _spec(session_id: str, agent: str, message: str) -> orc.RunTurnRequest:
    """A chat turn of `agent` in session `session_id`."""
    return orc.RunTurnRequest(
        trace_id=session_id,
        agent=agent,
        user_text=message,
        stream_key=session_key(session_id),
        role=rt.RUN_ROLE_SUPERVISOR,
        source=tp.MESSAGE_SOURCE_USER,
        stream_metadata=_stream_metadata(agent),
    )


class LastAgents:
    """The agent each user's slug was last read as (at most `size`, the least recently used go first).
    A new session's run starts with it while the agent is read again: when the read differs, that run
    is dropped before it stored anything and the turn runs the agent as read, so an edit still applies
    to the next turn."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._agents: OrderedDict[tuple[str, str], ap.Agent] = OrderedDict()

    def get(self, user: str, slug: str) -> ap.Agent | None:
        agent = self._agents.get((user, slug))
        if agent is not None:
            self._agents.move_to_end((user, slug))
        return agent

    def put(self, user: str, slug: str, agent: ap.Agent) -> None:
        self._agents[(user, slug)] = agent
        self._agents.move_to_end((user, slug))
        while len(self._agents) > self.size:
            self._agents.popitem(last=False)

    def forget(self, user: str, slug: str) -> None:
        self._agents.pop((user, slug), None)


class ChatOrchestrator:
    def __init__(
        self,
        settings: MeshSettings,
        clients: Clients,
        leases: LeaseKeeper | None = None,
        metrics: OrchestratorMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.clients = clients
        self.turns = TurnEngine(clients, leases, metrics=metrics)
        self.running: dict[str, asyncio.Task[TurnOutcome]] = {}
        self.last_agents = LastAgents()

    async def execute(
        self,
        agent: str,
        message: str,
        session_id: str,
        *,
        any_kind: bool = False,
        events_from_stream: bool = False,
    ) -> AsyncIterator[list[ev.Event] | str]:
        """Starts a chat turn of the calling user and yields its events (with offsets), in batches of
        what is ready, until the buffer closes. `any_kind` (ContinueTrace, POST /api/traces/{id}/run):
        the trace may be of any kind, and an empty `agent` is the trace's own. `events_from_stream`: the
        caller reads the events from the buffer: first the session id is yielded, as soon as the
        buffer exists (its first event will be `start`, or why the turn did not begin), then only what
        the buffer could not take (no offset). A new session's id may come before its agent is
        confirmed: if the agent changed since this user last read it, that buffer ends `cancelled` and
        the id of the session the turn runs in follows (read that one instead)."""
        if not message.strip():
            raise InvalidArgument("message must not be empty")
        if len(message) > MAX_MESSAGE_CHARS:
            raise InvalidArgument(f"message is longer than {MAX_MESSAGE_CHARS} characters")
        new_trace: tp.Trace | None = None
        announced = ""  # the session said before its turn began
        buffer: asyncio.Future[Any] | None = None
        early: grpc.aio.UnaryStreamCall | None = None
        begun: asyncio.Future[ms.BeginTurnResponse] | None = None
        if any_kind:
            if not is_local_id(session_id):
                raise InvalidArgument(
                    "a peer's trace is continued at its home (its POST /api/traces/{id}/run), or by "
                    "agent-invoke with continueFrom"
                )
            session = (await rpc(self.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=session_id)))).trace
            agent = agent or session.agent
            found = (await rpc(self.clients.agents.GetAgent(ag.GetAgentRequest(slug=agent)))).agent
            _refuse_copies(session)
        elif session_id:  # the session; its agent is read by the turn's BeginTurn (resolve_agent)
            request = ts.GetTraceRequest(trace_id=session_id)
            session = (
                await rpc(self.clients.trace.GetTrace(request, timeout=self.turns.write_timeout_s))
            ).trace
            if session.kind != tp.TRACE_KIND_CHAT:
                raise InvalidArgument("only chat sessions take chat turns")
            _refuse_copies(session)
            found = None
        else:  # a new session: created with the turn's first messages, in the same call (BeginTurn)
            opening = self._open_session(agent, message, events_from_stream)
            if events_from_stream and opening.last is not None:
                # Said at once (its run started with the agent as last read), so that the caller
                # subscribes while BeginTurn confirms the agent.
                try:
                    await asyncio.wait({opening.buffer})
                    if not opening.buffer.cancelled() and opening.buffer.exception() is None:
                        announced = opening.session.id
                        yield announced
                except BaseException as exc:  # the caller left: nobody reads this session
                    await to_the_end(self._unused(opening, exc))
                    raise
            session, found, new_trace, buffer, early, begun = await self._confirm(opening)
        slug = found.slug if found is not None else agent
        if buffer is None:  # the session's lock against a second turn: awaited before BeginTurn
            buffer = self.turns.create_buffer(session_key(session.id), _stream_metadata(slug))
        spec = _spec(session.id, slug, message)
        queue: asyncio.Queue[ev.Event | _End | _Created] = asyncio.Queue()
        # The turn outlives this generator when the caller leaves; self.running keeps it.
        task = asyncio.create_task(
            self._turn(spec, queue, events_from_stream, new_trace, found, buffer, early, begun),
            name=f"turn:{session.id}",
        )
        previous = self.running.get(session.id)
        if previous is None or previous.done():
            self.running[session.id] = task
        while True:
            batch: list[ev.Event] = []
            item = await queue.get()
            while True:
                if isinstance(item, _End):
                    if batch:
                        yield batch
                    if item.error is not None:
                        raise item.error
                    return
                if isinstance(item, _Created):
                    if item.session_id != announced:  # (said already: once is enough)
                        if batch:
                            yield batch
                            batch = []
                        yield item.session_id
                else:
                    batch.append(item)
                    if events.kind(item) in events.TERMINAL:
                        yield batch
                        return
                if queue.empty():
                    break
                item = queue.get_nowait()
            if batch:
                yield batch

    def _open_session(self, agent: str, message: str, from_stream: bool) -> _Opening:
        """A new session: its buffer is created while its agent is read; its run and its BeginTurn
        start meanwhile with the agent as this user last read it, kept when the read confirms it
        (`_confirm`) and undone otherwise."""
        session = tp.Trace(id=new_id())
        last = self.last_agents.get(identity.current_user(), agent)
        early = begun = None
        spec = _spec(session.id, agent, message)
        if last is not None:  # its run first (the first delta's path), then its buffer and BeginTurn
            early = self.turns.start_early(spec, not from_stream, last)
        buffer = self.turns.create_buffer(session_key(session.id), _stream_metadata(agent))
        reading: asyncio.Future[Any]
        if last is not None:  # BeginTurn reads the agent again (resolve_agent)
            reading = begun = self.turns.begin_early(spec, _new_trace(last.slug, message), agent, last)
        else:
            read = self.clients.agents.GetAgent(
                ag.GetAgentRequest(slug=agent), timeout=self.turns.write_timeout_s
            )
            reading = asyncio.ensure_future(rpc(read))
        return _Opening(session, agent, message, last, buffer, early, begun, reading)

    async def _unused(self, opening: _Opening, why: BaseException) -> None:
        """Nobody will read this session: its run stops, its trace goes, its buffer ends with `why`."""
        if opening.early is not None:
            opening.early.cancel()
        if opening.begun is not None:
            await to_the_end(self.turns.drop_begun(opening.begun, opening.session.id))
        else:
            opening.reading.cancel()
        key = session_key(opening.session.id)
        await to_the_end(self.turns.end_unused(opening.buffer, key, why))

    async def _confirm(self, opening: _Opening) -> _Opened:
        """The session `_open_session` began, once its agent is read: as begun when the agent is as
        last read, else a session of its own for the agent as read."""
        user, agent = identity.current_user(), opening.agent
        try:
            found = (await opening.reading).agent
        except BaseException as exc:  # no turn: the buffer nobody will read ends with the refusal
            self.last_agents.forget(user, agent)
            await self._unused(opening, exc)
            raise
        self.last_agents.put(user, agent, found)
        session, buffer, early, begun = opening.session, opening.buffer, opening.early, opening.begun
        if opening.last is not None and found != opening.last:
            # Changed since: that run may hold a reply for this buffer's `start`; the session is
            # left unused and the turn runs the agent as read, in a session of its own.
            await self._unused(opening, Cancelled("the agent changed"))
            early = begun = None
            session = tp.Trace(id=new_id())
            buffer = self.turns.create_buffer(session_key(session.id), _stream_metadata(found.slug))
        return _Opened(session, found, _new_trace(found.slug, opening.message), buffer, early, begun)

    async def run_turn(self, spec: orc.RunTurnRequest) -> TurnOutcome:
        """A child turn (agent-invoke callee, subagent), run to its end for the calling runtime (its
        events are in its own buffer, where its readers follow them)."""
        agent = spec.resolved_agent if spec.HasField("resolved_agent") else None
        return await self.turns.run(spec, run_events=False, agent=agent)

    async def _turn(
        self,
        spec: orc.RunTurnRequest,
        queue: asyncio.Queue[ev.Event | _End | _Created],
        from_stream: bool,
        new_trace: tp.Trace | None,
        agent: ap.Agent | None,
        buffer: asyncio.Future[Any],
        early: grpc.aio.UnaryStreamCall | None = None,
        begun: asyncio.Future[ms.BeginTurnResponse] | None = None,
    ) -> TurnOutcome:
        """Runs the turn, handing its events to `queue` (from_stream: once the buffer exists, that it
        does, then the events without an offset alone: the caller reads the rest from the buffer).
        From the buffer's creation on, a watcher cancels the turn when someone else cancels it."""
        watcher: asyncio.Task[None] | None = None
        current = asyncio.current_task()
        assert current is not None
        delivered_terminal = created = False

        def on_created(done: asyncio.Future[Any]) -> None:
            nonlocal watcher, created
            if done.cancelled() or done.exception() is not None or current.done():
                return
            created = True
            watcher = asyncio.create_task(self._watch(spec, current))
            if from_stream:
                queue.put_nowait(_Created(spec.trace_id))

        buffer.add_done_callback(on_created)

        def on_event(event: ev.Event) -> None:
            nonlocal delivered_terminal
            if events.kind(event) in events.TERMINAL:
                delivered_terminal = True
            if not from_stream or not event.offset:
                queue.put_nowait(event)

        def ended_elsewhere(err: MeshError) -> None:
            """Its buffer was ended by someone else (a cancel, a lease that ran out): say how, unless
            the caller reads that buffer, whose own terminal event says it."""
            if not delivered_terminal and not (from_stream and created):
                queue.put_nowait(events.error(err))

        try:
            outcome = await self.turns.run(
                spec, on_event, new_trace, not from_stream, agent, buffer, early, begun
            )
            ended_elsewhere(outcome.error or Internal("the turn ended without an outcome"))
            queue.put_nowait(_End())
            return outcome
        except asyncio.CancelledError as exc:
            ended_elsewhere(cancel_reason(exc))
            queue.put_nowait(_End())
            raise
        except MeshError as err:
            queue.put_nowait(_End(err))
            return TurnOutcome(error=err)
        except Exception as exc:  # pragma: no cover - defensive: never leave a caller hanging
            log.exception("turn crashed")
            queue.put_nowait(_End(exc))
            raise
        finally:
            if self.running.get(spec.trace_id) is current:
                del self.running[spec.trace_id]
            if watcher is not None:
                watcher.cancel()

    async def _watch(self, spec: orc.RunTurnRequest, turn: asyncio.Task[object]) -> None:
        """Cancels `turn` when someone else closes its buffer (just created: read from its beginning)
        with code `cancelled`."""
        follow = self.clients.follows.follow(
            spec.stream_key, idle_timeout_ms=int(self.settings.turn_timeout_s * 1000), terminal_only=True
        )
        try:
            async for event in follow:
                cancelled = event.HasField("error") and event.error.code == ev.ERROR_CODE_CANCELLED
                if cancelled and not turn.done():
                    turn.cancel()
                if events.kind(event) in events.TERMINAL:
                    return
        except MeshError:
            return
        finally:
            follow.cancel()

    async def cancel(self, session_id: str) -> bool:
        """Cancels the running turn of a session of the calling user (NOT_FOUND for anyone else's), and
        always settles: a placeholder left pending by a turn that died with its process (or whose
        buffer is already gone) is marked cancelled too. True when anything was cancelled."""
        session = (await rpc(self.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=session_id)))).trace
        closed = False
        try:
            resp = await self.clients.stream.CloseStream(
                ss.CloseStreamRequest(
                    key=session_key(session_id), error=Cancelled("cancelled by the user").to_event()
                )
            )
            closed = resp.closed
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # no buffer: maybe a pending placeholder is left
                raise from_rpc_error(exc) from exc
        local = self.running.get(session_id)
        if local is not None and not local.done():
            local.cancel()
            return True
        try:
            settled = await self._settle_head(session)
        except grpc.aio.AioRpcError as exc:  # the cancel itself succeeded; the rest is tidying
            log.warning("could not settle the head of %s: %s", session_id, exc.details())
            settled = False
        return closed or settled

    async def _settle_head(self, session: tp.Trace) -> bool:
        """A turn that died with its process left its placeholder (the head) pending: mark it cancelled.
        A live turn on another replica marks it the same way, so the two cannot disagree."""
        if not session.head_sequence:
            return False
        head = await self.clients.messages.ListMessages(
            ms.ListMessagesRequest(
                trace_id=session.id,
                head_sequence=session.head_sequence,
                since_sequence=session.head_sequence - 1,
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

    async def delete(self, session_id: str | None) -> tuple[int, int]:
        """Deletes a session of the calling user (None: every one) and everything under it; returns
        (traces removed, buffers ended). The buffers of the whole tree end with `cancelled` first, so
        the turn running on any replica stops (its watcher sees the close) and every reader gets a
        terminal event; then the rows go, then the buffers become unreadable."""
        if session_id is None:
            deleted = await rpc(self.clients.trace.DeleteTraces(ts.DeleteTracesRequest()))
        else:
            deleted = await rpc(self.clients.trace.DeleteTrace(ts.DeleteTraceRequest(trace_id=session_id)))
        keys = [
            *(session_key(t) for t in deleted.deleted_trace_ids),
            *(a2a_key(t) for t in deleted.deleted_task_ids),
            *(subagent_key(s) for s in deleted.deleted_subagent_ids),
        ]
        for trace_id in deleted.deleted_trace_ids:
            local = self.running.get(trace_id)
            if local is not None and not local.done():
                local.cancel()
        resp = await rpc(
            self.clients.stream.DeleteStreams(
                ss.DeleteStreamsRequest(keys=keys, error=Cancelled("the session was deleted").to_event())
            )
        )
        return len(deleted.deleted_trace_ids), resp.deleted_count

    async def drain(self, grace_s: float) -> None:
        """Shutdown: let running turns finish within the grace; the rest end `interrupted`."""
        tasks = [t for t in self.running.values() if not t.done()]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=grace_s)
        for task in pending:
            task.cancel(SHUTDOWN)
        if pending:
            await asyncio.wait(pending, timeout=5)
