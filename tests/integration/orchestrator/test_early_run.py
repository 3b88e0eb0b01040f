"""The run of a new session starts while BeginTurn stores its messages (RunAgentRequest.await_start):
it calls the model at once, stores nothing before the turn's `start`, and a turn that fails to begin
ends every stream with a terminal event, leaving no row behind."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.errors import Unavailable
from agentmesh.libs.ids import new_id, session_key
from agentmesh.libs.rpc import channel
from agentmesh.libs.turns import turn_messages
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.agent_runtime.sink import EventSink
from agentmesh.services.trace.starts import TurnStarts
from agentmesh.services.trace.store.sql.agents import SqlAgentStore
from agentmesh.services.trace.store.sql.messages import SqlMessageStore
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.stream.v1 import stream_service_pb2_grpc
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.mesh import BACKENDS, Mesh, chat, mesh_on, read_buffer, sse_events, system_of

FAST = {"rules": [], "default": {"text": "early " * 30}}  # at top speed: ready before the turn begins


@pytest.fixture(scope="module", params=BACKENDS)
async def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Mesh]:
    m = await mesh_on(request, tmp_path_factory.mktemp("early"), rules=FAST)
    yield m
    await m.stop()


async def test_a_fast_reply_follows_start(mesh: Mesh) -> None:
    """The whole reply is ready before the turn's messages are stored: it still comes after `start`,
    whole, and the placeholder (the run's anchor) gets it."""
    mesh.mock.set_rules(FAST)
    got = await chat(mesh, "general", "quick")
    kinds = [e["type"] for e in got]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds
    assert "".join(e["textDelta"] for e in got if e["type"] == "text-delta") == "early " * 30
    start = got[0]
    async with mesh.http() as http:
        resp = await http.get(f"/api/sessions/{start['sessionId']}/messages")
    messages = resp.json()["messages"]
    assert [(m["role"], m["status"]) for m in messages] == [("user", "completed"), ("assistant", "completed")]
    assert messages[1]["id"] == start["assistantMessageId"] and messages[1]["content"] == "early " * 30


async def test_a_turn_that_fails_to_begin_after_its_run_started(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """BeginTurn fails once the run has called the model: the client gets an error, the run stores
    nothing in the buffer, which ends with the error, and no trace (so no pending row) is left."""
    mesh.mock.set_rules(FAST)
    asked = len(mesh.mock.requests())
    tried: list[str] = []

    async def down(self: SqlMessageStore, owner: str, trace: tp.Trace, trace_id: str, messages: Any) -> Any:
        tried.append(trace_id)
        await mesh.mock.wait_requests(asked + 1)  # the run is under way: its reply is on its way
        raise Unavailable("the database went away")

    monkeypatch.setattr(SqlMessageStore, "create_trace_with_messages", down)
    async with mesh.http() as http:
        resp = await http.post("/api/chat", json={"agent": "general", "message": "doomed"})
    assert resp.status_code == 503, resp.text
    assert resp.json()["error"]["message"] == "the database went away", resp.json()
    (trace_id,) = tried
    monkeypatch.undo()
    buffered = await read_buffer(mesh, session_key(trace_id))
    assert [events.kind(e) for e in buffered] == ["error"], buffered
    assert buffered[0].error.code == ev.ERROR_CODE_UNAVAILABLE
    assert mesh.clients is not None
    with identity.acting_as(mesh.user), pytest.raises(grpc.aio.AioRpcError) as missing:
        await mesh.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=trace_id))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    # The mesh goes on: the next turn is whole.
    again = await chat(mesh, "general", "after")
    assert [e["type"] for e in again][-1] == "done"


async def run_request(mesh: Mesh, key: str) -> rt.RunAgentRequest:
    assert mesh.clients is not None
    agent = (await mesh.clients.agents.GetAgent(ag.GetAgentRequest(slug="general"))).agent
    return rt.RunAgentRequest(
        agent="general",
        trace_id=new_id(),
        stream_key=key,
        resolved_agent=agent,
        history=[tp.Message(role=tp.MESSAGE_ROLE_USER, content="gated")],
        history_given=True,
        result_only=True,
        await_start=True,
    )


async def gated_run(mesh: Mesh) -> tuple[str, Any]:
    """A new buffer and a run on it that awaits its start, once the model has its request."""
    assert mesh.clients is not None
    mesh.mock.set_rules(FAST)
    key = session_key(new_id())
    asked = len(mesh.mock.requests())
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        call = mesh.clients.runtime.RunAgent(await run_request(mesh, key), timeout=30)
    await mesh.mock.wait_requests(asked + 1)
    return key, call


async def test_a_run_stores_nothing_before_start(mesh: Mesh) -> None:
    """Called directly: the run holds its reply until `start` is in its buffer, then stores it after."""
    key, call = await gated_run(mesh)
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        info = await mesh.clients.stream.GetStreamInfo(ss.GetStreamInfoRequest(key=key))
        assert info.exists and not info.last_offset  # the model answers; nothing is stored yet
        start = ev.Event(start=ev.TurnStart(session_id="s", user_message_id=1, assistant_message_id=2))
        await mesh.clients.stream.AppendEvents(ss.AppendEventsRequest(key=key, events=[start]))
        responses = [resp async for resp in call]
    assert responses[-1].result.content == "early " * 30
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone()))
    buffered = await read_buffer(mesh, key)
    kinds = [events.kind(e) for e in buffered]
    assert kinds[0] == "start" and set(kinds[1:-1]) == {"text_delta"}, kinds


async def test_a_run_reads_no_further_than_its_first_delta_before_start(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While its turn is being stored, a run takes the model's first delta and leaves the rest of the
    reply in its socket (the cores go to storing the turn); after `start` it reads the rest."""
    emitted: list[str] = []
    first = asyncio.Event()
    emit = EventSink.emit

    def counted(self: EventSink, event: ev.Event) -> None:
        if event.HasField("text_delta"):
            emitted.append(event.text_delta.text_delta)
            first.set()
        emit(self, event)

    monkeypatch.setattr(EventSink, "emit", counted)
    key, call = await gated_run(mesh)
    assert mesh.clients is not None
    await mesh.mock.wait_idle()  # the whole reply is written to the run's socket
    await asyncio.wait_for(first.wait(), 10)
    for _ in range(200):  # the loop runs: an unheld run would read on now
        await asyncio.sleep(0)
    assert emitted == ["early "], emitted
    with identity.acting_as(mesh.user):
        start = ev.Event(start=ev.TurnStart(session_id="s", user_message_id=1, assistant_message_id=2))
        await mesh.clients.stream.AppendEvents(ss.AppendEventsRequest(key=key, events=[start]))
        responses = [resp async for resp in call]
        await mesh.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone()))
    assert responses[-1].result.content == "early " * 30 and len(emitted) == 30


async def test_a_run_whose_buffer_ends_before_start_stores_nothing(mesh: Mesh) -> None:
    key, call = await gated_run(mesh)
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        ended = Unavailable("the turn failed to begin").to_event()
        await mesh.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=ended))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            async for _ in call:
                pass
    assert failed.value.code() == grpc.StatusCode.CANCELLED, failed.value
    assert "before its turn started" in (failed.value.details() or "")
    assert [events.kind(e) for e in await read_buffer(mesh, key)] == ["error"]


async def test_await_start_needs_the_history(mesh: Mesh) -> None:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        request = await run_request(mesh, session_key(new_id()))
    request.history_given = False
    del request.history[:]
    with identity.acting_as(mesh.user), pytest.raises(grpc.aio.AioRpcError) as refused:
        async for _ in mesh.clients.runtime.RunAgent(request, timeout=10):
            pass
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# ---- a new session's run with the agent as last read ------------------------------------------------

ONE_OR_TWO = {
    "rules": [
        {"system": "version one", "text": "reply one " * 5},
        {"system": "version two", "text": "reply two " * 5},
    ],
    "default": {"text": "early " * 30},
}


async def _own_agent(mesh: Mesh, slug: str, prompt: str) -> None:
    async with mesh.http() as http:
        resp = await http.post("/api/agents", json={"slug": slug, "name": slug, "systemPrompt": prompt})
    assert resp.status_code in (200, 201), resp.text


def _text(got: list[dict[str, Any]]) -> str:
    return "".join(e["textDelta"] for e in got if e["type"] == "text-delta")


async def test_a_new_session_calls_the_model_while_its_agent_is_read_again(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's agent was read for an earlier turn: a new session's run starts with it at once, and
    its BeginTurn reads the agent again in the same call before it stores the turn: the model is asked
    before that read answers; the turn is whole."""
    mesh.mock.set_rules(FAST)
    await chat(mesh, "general", "warm up")
    asked = len(mesh.mock.requests())
    reads: list[str] = []
    order: list[str] = []
    original, create = SqlAgentStore.get_agent, SqlMessageStore.create_trace_with_messages

    async def late(self: SqlAgentStore, owner: str, slug: str) -> Any:
        reads.append(slug)
        await mesh.mock.wait_requests(asked + 1)  # the run asked the model before this answers
        order.append("read")
        return await original(self, owner, slug)

    async def storing(self: SqlMessageStore, *args: Any) -> Any:
        order.append("store")
        return await create(self, *args)

    monkeypatch.setattr(SqlAgentStore, "get_agent", late)
    monkeypatch.setattr(SqlMessageStore, "create_trace_with_messages", storing)
    got = await chat(mesh, "general", "again")
    monkeypatch.undo()
    assert "general" in reads and order == ["read", "store"]  # the agent first, in the one BeginTurn
    kinds = [e["type"] for e in got]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds
    assert _text(got) == "early " * 30
    assert len(mesh.mock.requests()) == asked + 1, "one model request: the run started early was kept"


async def test_an_edit_between_turns_drops_the_early_run(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent edited since it was last read: the run started with the old version is dropped before
    it stores anything (its reply, held for a `start`, never lands), and the turn runs the edited
    agent in a session of its own, whose buffer holds that reply alone."""
    slug = f"spec-{new_id()[:8]}"
    mesh.mock.set_rules(ONE_OR_TWO)
    await _own_agent(mesh, slug, "You are version one.")
    assert _text(await chat(mesh, slug, "first")) == "reply one " * 5
    async with mesh.http() as http:
        resp = await http.patch(f"/api/agents/{slug}", json={"systemPrompt": "You are version two."})
    assert resp.status_code == 200, resp.text
    asked = len(mesh.mock.requests())
    original = SqlAgentStore.get_agent

    async def late(self: SqlAgentStore, owner: str, s: str) -> Any:
        await mesh.mock.wait_requests(asked + 1)  # the run with version one has asked the model
        return await original(self, owner, s)

    monkeypatch.setattr(SqlAgentStore, "get_agent", late)
    async with mesh.http() as http:
        before = len((await http.get("/api/sessions?page_size=200")).json()["sessions"])
    got = await chat(mesh, slug, "second")
    monkeypatch.undo()
    async with mesh.http() as http:
        after = len((await http.get("/api/sessions?page_size=200")).json()["sessions"])
    assert after == before + 1, "the session begun with the old agent is gone"
    assert _text(got) == "reply two " * 5, got
    systems = [system_of(body) for body in mesh.mock.requests()[asked:]]
    assert any("version one" in s for s in systems), "the early run asked the model with the old agent"
    assert "version two" in systems[-1]
    session = got[0]["sessionId"]
    buffered = await read_buffer(mesh, session_key(session))
    kinds = [events.kind(e) for e in buffered]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds
    assert (
        "".join(e.text_delta.text_delta for e in buffered if events.kind(e) == "text_delta")
        == "reply two " * 5
    )
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    assert [m["content"] for m in messages] == ["second", "reply two " * 5]


async def test_a_deleted_agent_refuses_the_turn_and_drops_the_early_run(mesh: Mesh) -> None:
    """The agent was deleted since it was last read: 404 as before, the run started early stores
    nothing, and no session is left."""
    slug = f"gone-{new_id()[:8]}"
    mesh.mock.set_rules(ONE_OR_TWO)
    await _own_agent(mesh, slug, "You are version one.")
    assert _text(await chat(mesh, slug, "first")) == "reply one " * 5
    async with mesh.http() as http:
        assert (await http.delete(f"/api/agents/{slug}")).status_code in (200, 204)
        before = (await http.get("/api/sessions")).json()
        resp = await http.post("/api/chat", json={"agent": slug, "message": "anyone?"})
        assert resp.status_code == 404, resp.text
        after = (await http.get("/api/sessions")).json()
    assert after == before, "no session was created"


async def test_a_new_session_is_said_before_its_agent_is_confirmed(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ExecuteChat (events_from_stream) says a new session as soon as its buffer exists, while
    BeginTurn is still reading the agent, so that the caller subscribes meanwhile; when the agent
    changed since, that buffer ends `cancelled` and the session the turn runs in is said next, whose
    buffer holds the reply of the edited agent (the gateway reads that one: the edit test above)."""
    from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

    slug = f"said-{new_id()[:8]}"
    mesh.mock.set_rules(ONE_OR_TWO)
    await _own_agent(mesh, slug, "You are version one.")
    assert _text(await chat(mesh, slug, "first")) == "reply one " * 5  # now this user's last read
    gate = asyncio.Event()
    original = SqlAgentStore.get_agent

    async def held(self: SqlAgentStore, owner: str, s: str) -> Any:
        await gate.wait()
        return await original(self, owner, s)

    monkeypatch.setattr(SqlAgentStore, "get_agent", held)
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        call = mesh.clients.orchestrator.ExecuteChat(
            orc.ExecuteChatRequest(agent=slug, message="same", events_from_stream=True), timeout=30
        )
        async with asyncio.timeout(10):
            said = await call.read()
        assert said.session_id and not gate.is_set(), "said while the agent is being read"
        gate.set()
        assert [r async for r in call] == [], "the agent as last read: nothing else is said"
    kinds = [events.kind(e) for e in await read_buffer(mesh, session_key(said.session_id))]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds

    async with mesh.http() as http:
        resp = await http.patch(f"/api/agents/{slug}", json={"systemPrompt": "You are version two."})
    assert resp.status_code == 200, resp.text
    gate.clear()
    with identity.acting_as(mesh.user):
        call = mesh.clients.orchestrator.ExecuteChat(
            orc.ExecuteChatRequest(agent=slug, message="edited", events_from_stream=True), timeout=30
        )
        async with asyncio.timeout(10):
            said = await call.read()
        gate.set()
        moved = [r.session_id async for r in call if r.session_id]
    monkeypatch.undo()
    assert len(moved) == 1 and moved[0] != said.session_id, moved
    given_up = await read_buffer(mesh, session_key(said.session_id))
    assert [events.kind(e) for e in given_up] == ["error"], given_up
    assert given_up[0].error.code == ev.ERROR_CODE_CANCELLED
    taken = await read_buffer(mesh, session_key(moved[0]))
    assert (
        "".join(e.text_delta.text_delta for e in taken if events.kind(e) == "text_delta") == "reply two " * 5
    )


async def _paced_chat(mesh: Mesh, agent: str, message: str) -> list[tuple[float, dict[str, Any]]]:
    """One turn over POST /api/chat: each SSE event with its arrival time."""
    got: list[tuple[float, dict[str, Any]]] = []
    loop = asyncio.get_running_loop()
    async with (
        mesh.http() as http,
        http.stream("POST", "/api/chat", json={"agent": agent, "message": message}) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        async with asyncio.timeout(20):
            async for event in sse_events(resp):
                got.append((loop.time(), event))
    return got


def _live(got: list[tuple[float, dict[str, Any]]], text: str) -> None:
    """The reply `text` arrived whole, token by token, its first text long before the turn's end."""
    kinds = [e["type"] for _, e in got]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds
    deltas = [t for t, e in got if e["type"] == "text-delta"]
    assert len(deltas) >= 10, "paced tokens arrive one by one, not as one block"
    assert got[-1][0] - deltas[0] > 0.3, "the first text came long before the turn's end"
    assert "".join(e["textDelta"] for _, e in got if e["type"] == "text-delta") == text


async def test_a_session_said_early_streams_live_at_a_model_pace(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a realistic pace, over SSE: a new session said before its agent is confirmed streams its
    reply as it comes, and so does the session a turn moved to when the agent had changed."""
    slug = f"paced-{new_id()[:8]}"
    paced = {
        "rules": [
            {"system": "version one", "text": "one " * 20, "tokens_per_second": 40},
            {"system": "version two", "text": "two " * 20, "tokens_per_second": 40},
        ],
        "default": {"text": "early " * 30},
    }
    mesh.mock.set_rules(paced)
    await _own_agent(mesh, slug, "You are version one.")
    assert [e["type"] for e in await chat(mesh, slug, "first")][-1] == "done"  # this user's last read
    _live(await _paced_chat(mesh, slug, "again"), "one " * 20)  # said before BeginTurn confirmed it

    async with mesh.http() as http:
        resp = await http.patch(f"/api/agents/{slug}", json={"systemPrompt": "You are version two."})
    assert resp.status_code == 200, resp.text
    asked = len(mesh.mock.requests())
    original = SqlAgentStore.get_agent

    async def late(self: SqlAgentStore, owner: str, s: str) -> Any:
        await mesh.mock.wait_requests(asked + 1)  # the run with version one has asked the model
        return await original(self, owner, s)

    monkeypatch.setattr(SqlAgentStore, "get_agent", late)
    got = await _paced_chat(mesh, slug, "edited")
    monkeypatch.undo()
    _live(got, "two " * 20)  # read from the session the turn moved to
    assert any("version one" in system_of(b) for b in mesh.mock.requests()[asked:]), (
        "the early run was dropped"
    )


def _begin(trace_id: str, key: str, text: str, agent: str = "general") -> ms.BeginTurnRequest:
    """The BeginTurn of a new chat session `trace_id` that puts its `start` in buffer `key`."""
    user, placeholder = turn_messages(trace_id, text)
    return ms.BeginTurnRequest(
        trace_id=trace_id,
        new_trace=tp.Trace(agent=agent, kind=tp.TRACE_KIND_CHAT, title=text),
        user_message=user,
        assistant_message=placeholder,
        start_key=key,
        start=ev.TurnStart(agent=agent),
    )


async def _ended(mesh: Mesh, key: str) -> list[ev.Event]:
    """Every event of buffer `key`, once it is closed here."""
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone()))
    return await read_buffer(mesh, key)


async def test_begin_turn_puts_the_turns_start_in_its_buffer(mesh: Mesh) -> None:
    """BeginTurn with start_key appends the turn's `start` (the stored ids, the session) to the buffer
    as the caller, once the messages are stored, and answers with its offset."""
    assert mesh.clients is not None
    trace_id = new_id()
    key = session_key(trace_id)
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        begun = await mesh.clients.messages.BeginTurn(_begin(trace_id, key, "started here"))
    assert begun.start_offset and not begun.HasField("start_error"), begun
    first, last = await _ended(mesh, key)
    assert first.offset == begun.start_offset and events.kind(last) == "done"
    assert first.start == ev.TurnStart(
        session_id=trace_id,
        user_message_id=begun.user_message.id,
        assistant_message_id=begun.assistant_message.id,
        agent="general",
    )


async def test_begin_turn_leaves_the_start_to_the_caller_when_it_cannot_append_it(mesh: Mesh) -> None:
    """The messages are stored and no `start` is appended (the caller appends it) when the agent read
    is not the one the caller expected, or the buffer is not there yet; start_key without the start
    is refused before anything is stored."""
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        agent = (await mesh.clients.agents.GetAgent(ag.GetAgentRequest(slug="general"))).agent
        stale = ap.Agent()
        stale.CopyFrom(agent)
        stale.system_prompt += " (as it was)"
        trace_id = new_id()
        key = session_key(trace_id)
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        request = _begin(trace_id, key, "another agent")
        request.resolve_agent = "general"
        request.start_if_agent.CopyFrom(stale)
        begun = await mesh.clients.messages.BeginTurn(request)
        assert begun.agent == agent and begun.assistant_message.id
        assert not begun.start_offset and not begun.HasField("start_error"), begun
        assert [events.kind(e) for e in await _ended(mesh, key)] == ["done"]

        unmade = new_id()
        request = _begin(unmade, session_key(unmade), "no buffer yet")
        request.resolve_agent = "general"
        request.start_if_agent.CopyFrom(agent)  # as expected this time
        begun = await mesh.clients.messages.BeginTurn(request)
        assert begun.assistant_message.id and not begun.start_offset and not begun.HasField("start_error")

        unsaid = _begin(new_id(), key, "no start")
        unsaid.ClearField("start")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await mesh.clients.messages.BeginTurn(unsaid)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
        assert "start_key needs the turn's start" in (refused.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as missing:
            await mesh.clients.trace.GetTrace(ts.GetTraceRequest(trace_id=unsaid.trace_id))
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_start_that_may_be_stored_is_an_error_not_a_second_start(mesh: Mesh) -> None:
    """An append of `start` that fails without a refusal (here: no stream service at that address)
    may have been stored: BeginTurn says so (start_error) rather than leave the caller to append a
    second one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed below: nobody listens there
    dead = channel(f"127.0.0.1:{port}", mesh.signer)
    try:
        starts = TurnStarts(lambda: stream_service_pb2_grpc.StreamServiceStub(dead), timeout_s=5.0)
        with identity.acting_as(mesh.user):
            offset, error = await starts.append("session:nowhere", ev.TurnStart(session_id="nowhere"), 5.0)
    finally:
        await dead.close()
    assert offset == "" and error is not None and error.code == ev.ERROR_CODE_UNAVAILABLE, (offset, error)


async def test_the_start_append_ends_within_the_callers_deadline(mesh: Mesh) -> None:
    """A stream service that never answers: the append gives up within what is left of BeginTurn's
    deadline (`within_s`), not its own longer timeout, and says it may have been stored."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()  # connections complete in the backlog; no HTTP/2 answer ever comes
        mute = channel(f"127.0.0.1:{s.getsockname()[1]}", mesh.signer)
        try:
            starts = TurnStarts(lambda: stream_service_pb2_grpc.StreamServiceStub(mute), timeout_s=30.0)
            loop = asyncio.get_running_loop()
            began = loop.time()
            with identity.acting_as(mesh.user):
                offset, error = await starts.append("session:mute", ev.TurnStart(session_id="mute"), 0.5)
            took = loop.time() - began
        finally:
            await mute.close()
    assert offset == "" and error is not None and error.code == ev.ERROR_CODE_TIMEOUT, error
    assert took < 10.0, took  # 0.45 s asked; the 30 s of its own timeout would fail this


async def test_a_turn_whose_start_may_be_stored_ends_with_the_error(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trace service appended `start` but its answer was lost: the turn does not append a second
    one; it ends with the error, its placeholder failed, and the client reads one `start`."""
    mesh.mock.set_rules(FAST)
    append = TurnStarts.append

    async def lost(self: TurnStarts, key: str, start: ev.TurnStart, within_s: Any = None) -> Any:
        await append(self, key, start, within_s)
        return "", ev.StreamError(code=ev.ERROR_CODE_UNAVAILABLE, message="the answer was lost")

    monkeypatch.setattr(TurnStarts, "append", lost)
    got = await chat(mesh, "general", "lost answer")
    monkeypatch.undo()
    kinds = [e["type"] for e in got]
    assert kinds.count("start") == 1 and kinds[0] == "start" and kinds[-1] == "error", kinds
    assert got[-1]["code"] == "unavailable" and "the answer was lost" in got[-1]["message"], got[-1]
    async with mesh.http() as http:
        resp = await http.get(f"/api/sessions/{got[0]['sessionId']}/messages")
    statuses = [(m["role"], m["status"]) for m in resp.json()["messages"]]
    assert statuses == [("user", "completed"), ("assistant", "failed")], statuses
    buffered = await read_buffer(mesh, session_key(got[0]["sessionId"]))
    assert [events.kind(e) for e in buffered].count("start") == 1
