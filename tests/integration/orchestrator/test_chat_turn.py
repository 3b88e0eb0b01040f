"""Foundation: one full chat turn through the whole mesh, over HTTP+SSE and WebSocket, on
SQLite + memory streams and on PostgreSQL + Redis streams."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
import websockets

from agentmesh.libs import identity
from agentmesh.libs.ids import parse_stream_key, trace_key
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.mesh import BACKENDS, Mesh, chat, sse_events

# Paced (20 ms a token): a new session's run calls the model while its turn is stored, and what the
# model said before the turn's `start` reaches the reader as one merged delta (a top-speed reply: all of it).
ECHO = {
    "rules": [],
    "default": {"text": "Hello there, you said {user}. Have a nice day.", "tokens_per_second": 50},
}


pytestmark = pytest.mark.mesh(backends=BACKENDS, llm_timeout_s=2.0)


def assert_turn(events: list[dict], text: str) -> dict:
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start", kinds
    assert kinds[-2:] == ["finish", "done"], kinds
    assert set(kinds[1:-2]) == {"text-delta"}, kinds
    assert len(kinds) > 4, "the reply must arrive as several deltas"
    start = events[0]
    assert (
        start["traceId"]
        and 0 < start["userMessageId"] < 2**53
        and 0 < start["assistantMessageId"] < 2**53
        and start["assistantMessageId"] != start["userMessageId"]
    )
    assert "".join(e["textDelta"] for e in events if e["type"] == "text-delta") == text
    offsets = [e["_id"] for e in events]
    assert all(offsets) and len(set(offsets)) == len(offsets), offsets
    finish = events[-2]
    assert finish["usage"]["inputTokens"] > 0 and finish["usage"]["outputTokens"] > 0
    return start


async def test_full_turn_over_sse(mesh: Mesh) -> None:
    mesh.mock.set_rules(ECHO)
    events = await chat(mesh, "general", "ping")
    start = assert_turn(events, "Hello there, you said ping. Have a nice day.")
    async with mesh.http() as http:
        resp = await http.get(f"/api/sessions/{start['traceId']}/messages")
    assert resp.status_code == 200, resp.text
    messages = resp.json()["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"]
    user, assistant = messages
    assert user["id"] == start["userMessageId"] and user["content"] == "ping"
    assert assistant["id"] == start["assistantMessageId"]
    assert assistant["content"] == "Hello there, you said ping. Have a nice day."
    assert assistant["status"] == "completed"
    assert assistant["model"] == "mock-gpt"
    assert assistant["usage"] == events[-2]["usage"]
    # A second turn in the same session sees the first one (the model received the history).
    mesh.mock.set_rules(ECHO)
    before = len(mesh.mock.requests())
    events2 = await chat(mesh, "general", "pong", session_id=start["traceId"])
    assert events2[0]["traceId"] == start["traceId"]
    sent = mesh.mock.requests()[before]["messages"]
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "user"]


async def test_same_turn_over_websocket(mesh: Mesh) -> None:
    mesh.mock.set_rules(ECHO)
    sse = await chat(mesh, "general", "same")
    url = mesh.url.replace("http://", "ws://") + "/api/ws"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {mesh.api_key}"}) as ws:
        await ws.send(json.dumps({"type": "chat", "agent": "general", "message": "same"}))
        got: list[dict] = []
        async with asyncio.timeout(30):
            while not got or got[-1]["type"] not in ("done", "error"):
                got.append(json.loads(await ws.recv()))

    # Both read session:<id>, where consecutive text deltas a reader reads at once arrive merged: the
    # same text and the same other events, the deltas maybe cut differently.
    def text(events: list[dict]) -> str:
        return "".join(e["textDelta"] for e in events if e["type"] == "text-delta")

    assert text(got) == text(sse)
    others, sse_others = ([e for e in events if e["type"] != "text-delta"] for events in (got, sse))
    assert [e["type"] for e in others] == [e["type"] for e in sse_others]
    for a, b in zip(others, sse_others, strict=True):
        strip = {"traceId", "userMessageId", "assistantMessageId", "_id", "offset"}
        assert {k: v for k, v in a.items() if k not in strip} == {
            k: v for k, v in b.items() if k not in strip
        }
    assert all(e["offset"] for e in got)


async def test_bad_input(mesh: Mesh) -> None:
    backend = mesh.servers["stream"].registrations[0].servicer.backend
    open_before = await backend.open_buffers()
    async with mesh.http() as http:
        listed = (await http.get("/api/sessions")).json()["sessions"]
        r = await http.post("/api/chat", json={"agent": "nobody", "message": "hi"})
        assert r.status_code == 404 and r.json()["error"]["reason"] == "NOT_FOUND"
        assert r.json()["error"]["message"] == "unknown agent 'nobody'"
        # The new session, stored while the agent was read, is gone with the refusal.
        assert (await http.get("/api/sessions")).json()["sessions"] == listed
    # Its buffer, made meanwhile too, ended with the refusal.
    assert await backend.open_buffers() == open_before
    async with mesh.http() as http:
        r = await http.post("/api/chat", json={"agent": "general", "message": "   "})
        assert r.status_code == 422 and "error" in r.json()
        r = await http.post("/api/chat", json={"agent": "general"})
        assert r.status_code == 422
    async with mesh.http(api_key="") as http:
        r = await http.post("/api/chat", json={"agent": "general", "message": "hi"})
        assert r.status_code == 401 and r.json()["error"]["reason"] == "UNAUTHENTICATED"
    async with mesh.http(api_key="am_wrong") as http:
        r = await http.post("/api/chat", json={"agent": "general", "message": "hi"})
        assert r.status_code == 401
        r = await http.get("/api/sessions")
        assert r.status_code == 401


async def test_a_chat_continued_with_an_unknown_agent_is_a_404_and_a_failed_turn(mesh: Mesh) -> None:
    """A continued chat's agent is read while its turn begins (docs/design/turns.md, "Begin"): an agent
    that is not there is a 404, and the turn is settled like any turn that failed, nothing left open."""
    trace = (await chat(mesh, "general", "hello"))[0]["traceId"]
    backend = mesh.servers["stream"].registrations[0].servicer.backend
    open_before = await backend.open_buffers()
    async with mesh.http() as http:
        r = await http.post("/api/chat", json={"traceId": trace, "agent": "nobody", "message": "again"})
        assert r.status_code == 404 and r.json()["error"]["message"] == "unknown agent 'nobody'"
        messages = (await http.get(f"/api/traces/{trace}/messages")).json()["messages"]
    assert [(m["role"], m["status"]) for m in messages] == [
        ("user", "completed"),
        ("assistant", "completed"),
        ("user", "completed"),
        ("assistant", "failed"),
    ]
    assert (messages[2]["content"], messages[3]["content"]) == ("again", "")
    assert messages[-1]["metadata"]["error"]["code"] == "not_found"
    assert await backend.open_buffers() == open_before
    events = await chat(mesh, "general", "and again", session_id=trace)  # the trace takes its next turn
    assert [events[0]["type"], events[-1]["type"]] == ["start", "done"]


def _early_runs(mesh: Mesh, outcome: str) -> float:
    registry = mesh.servers["orchestrator"].registry
    return registry.get_sample_value("agentmesh_orchestrator_early_runs_total", {"outcome": outcome}) or 0.0


async def _solo_agent(mesh: Mesh, slug: str, prompt: str) -> None:
    """An agent of the user's with no tool: a new chat of it runs early once it was read."""
    body = {"slug": slug, "name": slug, "systemPrompt": prompt, "model": "mock-gpt", "tools": []}
    async with mesh.http() as http:
        r = await http.post("/api/agents", json=body)
    assert r.status_code == 201, r.text


async def _chats_of(mesh: Mesh, slug: str) -> list[str]:
    async with mesh.http() as http:
        r = await http.get("/api/sessions", params={"pageSize": 200})
    assert r.status_code == 200, r.text
    return [s["id"] for s in r.json()["sessions"] if s["agent"] == slug]


async def test_a_new_chat_of_an_agent_read_before_runs_early_at_the_models_pace(
    mesh: Mesh, unique: str
) -> None:
    """A new chat's run starts with its agent as last read while the agent is read again
    (docs/design/turns.md, "The early run"): kept when the agent is unchanged, the text streaming at the
    model's pace before the turn ends, and the turn stored as any other."""
    slug = f"solo-{unique}"
    await _solo_agent(mesh, slug, "[solo] You answer.")
    mesh.mock.set_rules(ECHO)
    await chat(mesh, slug, "first")  # the agent read: the next new chat runs early
    kept = _early_runs(mesh, "kept")
    got = await _paced_turn(mesh, {"agent": slug, "message": "pace"})
    assert _early_runs(mesh, "kept") == kept + 1
    start = got[0][1]
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{start['traceId']}/messages")).json()["messages"]
    assert [(m["role"], m["status"]) for m in messages] == [("user", "completed"), ("assistant", "completed")]
    assert messages[1]["id"] == start["assistantMessageId"] and messages[1]["content"] == "tick " * 30
    assert len(await _chats_of(mesh, slug)) == 2


async def test_an_agent_edited_since_its_last_read_runs_as_edited_in_a_chat_of_its_own(
    mesh: Mesh, unique: str
) -> None:
    """An edit between two new chats: the second one's early run (the agent as before) is dropped, its
    chat deleted and its buffer ended, and the turn runs the agent as edited in a new chat; the reader
    sees that chat only, with none of the dropped run's text."""
    slug = f"edited-{unique}"
    mesh.mock.set_rules(
        {
            "rules": [
                {"system": r"\[before\]", "text": "stale " * 40, "tokens_per_second": 400},
                {"system": r"\[after\]", "text": "fresh reply"},
            ],
            "default": {"text": "x"},
        }
    )
    await _solo_agent(mesh, slug, "[before] You answer.")
    first = await chat(mesh, slug, "one")
    assert "stale" in "".join(e.get("textDelta", "") for e in first)
    async with mesh.http() as http:
        r = await http.patch(f"/api/agents/{slug}", json={"systemPrompt": "[after] You answer."})
    assert r.status_code == 200, r.text
    dropped = _early_runs(mesh, "dropped")
    backend = mesh.servers["stream"].registrations[0].servicer.backend
    open_before = await backend.open_buffers()
    second = await chat(mesh, slug, "two")
    assert _early_runs(mesh, "dropped") == dropped + 1
    assert [e["type"] for e in (second[0], *second[-2:])] == ["start", "finish", "done"], second
    assert "".join(e.get("textDelta", "") for e in second) == "fresh reply"
    trace = second[0]["traceId"]
    assert sorted(await _chats_of(mesh, slug)) == sorted([first[0]["traceId"], trace])
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{trace}/messages")).json()["messages"]
    assert [m["content"] for m in messages] == ["two", "fresh reply"]
    assert await backend.open_buffers() == open_before


async def test_an_agent_deleted_since_its_last_read_is_a_404_and_leaves_nothing(
    mesh: Mesh, unique: str
) -> None:
    """The read that confirms an early run finds no agent: the turn does not begin (404), its chat is
    deleted and its buffer ended, as for a chat of an unknown agent."""
    slug = f"gone-{unique}"
    await _solo_agent(mesh, slug, "[gone] You answer.")
    mesh.mock.set_rules(ECHO)
    first = (await chat(mesh, slug, "one"))[0]["traceId"]
    async with mesh.http() as http:
        assert (await http.delete(f"/api/agents/{slug}")).status_code == 200
    failed = _early_runs(mesh, "failed")
    backend = mesh.servers["stream"].registrations[0].servicer.backend
    open_before = await backend.open_buffers()
    async with mesh.http() as http:
        r = await http.post("/api/chat", json={"agent": slug, "message": "two"})
    assert r.status_code == 404 and r.json()["error"]["message"] == f"unknown agent {slug!r}", r.text
    assert _early_runs(mesh, "failed") == failed + 1
    assert await _chats_of(mesh, slug) == [first]
    assert await backend.open_buffers() == open_before


@pytest.mark.parametrize(
    ("fault", "code"),
    [("http_500", "model_error"), ("stall", "timeout"), ("stall_before", "timeout"), ("cut", "model_error")],
)
async def test_model_failure_marks_placeholder_failed(mesh: Mesh, fault: str, code: str) -> None:
    mesh.mock.set_rules({"rules": [{"user": "boom", "fault": fault}]})
    events = await chat(mesh, "general", "boom", timeout=40)
    assert events[0]["type"] == "start"
    assert events[-1]["type"] == "error", events
    assert events[-1]["code"] == code, events[-1]
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{events[0]['traceId']}/messages")).json()["messages"]
    assert messages[-1]["status"] == "failed"
    assert messages[-1]["metadata"]["error"]["code"] == events[-1]["code"]


async def test_disconnected_turn_goes_on_and_resumes(mesh: Mesh) -> None:
    mesh.mock.set_rules({"rules": [], "default": {"text": "word " * 60, "tokens_per_second": 200}})
    async with mesh.http() as http:
        async with http.stream("POST", "/api/chat", json={"agent": "general", "message": "long"}) as resp:
            got = []
            async for event in sse_events(resp):
                got.append(event)
                if sum(1 for e in got if e["type"] == "text-delta") == 3:
                    break  # the client goes away mid-turn
        session, last = got[0]["traceId"], got[-1]["_id"]
        async with http.stream(
            "GET", f"/api/sessions/{session}/stream", headers={"Last-Event-ID": last}
        ) as resp:
            assert resp.status_code == 200
            rest = [e async for e in sse_events(resp)]
    assert rest[-1]["type"] == "done"
    ids = [e["_id"] for e in got + rest]
    assert len(ids) == len(set(ids)), "no duplicate across the reconnect"
    whole = "".join(e["textDelta"] for e in got + rest if e["type"] == "text-delta")
    assert whole == "word " * 60, "no gap across the reconnect"
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    assert messages[-1]["status"] == "completed" and messages[-1]["content"] == "word " * 60


async def test_second_turn_on_a_busy_session_is_refused(mesh: Mesh) -> None:
    mesh.mock.set_rules({"rules": [], "default": {"text": "slow " * 40, "tokens_per_second": 100}})
    async with mesh.http() as http:
        async with http.stream("POST", "/api/chat", json={"agent": "general", "message": "one"}) as resp:
            stream = sse_events(resp)
            start = await anext(stream)
            busy = await http.post(
                "/api/chat", json={"agent": "general", "message": "two", "sessionId": start["traceId"]}
            )
            assert busy.status_code == 409 and busy.json()["error"]["reason"] == "FAILED_PRECONDITION"
            rest = [e async for e in stream]
        assert rest[-1]["type"] == "done", "the running turn is not disturbed"
        messages = (await http.get(f"/api/sessions/{start['traceId']}/messages")).json()["messages"]
        assert [m["content"] for m in messages if m["role"] == "user"] == ["one"]


async def test_cancel_releases_a_session_whose_turn_died(mesh: Mesh) -> None:
    """A turn whose process died leaves its buffer open; cancel closes it and the session works again."""
    mesh.mock.set_rules(ECHO)
    first = await chat(mesh, "general", "before the crash")
    session = first[0]["traceId"]
    assert mesh.clients is not None
    pending = tp.Message(role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING)
    died = ms.BeginTurnRequest(trace_id=session, user_message=tp.Message(role=tp.MESSAGE_ROLE_USER))
    died.assistant_message.CopyFrom(pending)  # a turn begun, then its process died
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=trace_key(session)))
        orphan = (await mesh.clients.messages.BeginTurn(died)).assistant_message
    async with mesh.http() as http:
        busy = await http.post("/api/chat", json={"agent": "general", "message": "x", "sessionId": session})
        assert busy.status_code == 409
        assert (await http.post(f"/api/sessions/{session}/cancel")).json() == {"cancelled": True}
    events = await chat(mesh, "general", "after", session_id=session)
    assert events[-1]["type"] == "done"
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{session}/messages", params={"mode": "all"})).json()[
            "messages"
        ]
    assert next(m for m in messages if m["id"] == orphan.id)["status"] == "cancelled", (
        "no placeholder left pending"
    )


async def test_long_trace_sends_the_newest_history(mesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentmesh.services.agent_runtime import runner

    monkeypatch.setattr(runner, "HISTORY_LIMIT", 3)
    mesh.mock.set_rules(ECHO)
    session = None
    for text in ("one", "two", "three"):
        events = await chat(mesh, "general", text, session_id=session)
        session = events[0]["traceId"]
    sent = mesh.mock.requests()[-1]["messages"]
    assert [(m["role"], m["content"]) for m in sent[1:]] == [
        ("user", "two"),
        ("assistant", "Hello there, you said two. Have a nice day."),
        ("user", "three"),
    ]


async def test_another_users_session_is_not_found(mesh: Mesh) -> None:
    mesh.mock.set_rules(ECHO)
    mine = (await chat(mesh, "general", "private"))[0]["traceId"]
    other = await mesh.new_user("oscar")
    async with mesh.http(api_key=other) as http:
        r = await http.post("/api/chat", json={"agent": "general", "message": "hi", "sessionId": mine})
        assert r.status_code == 404 and r.json()["error"]["reason"] == "NOT_FOUND"
        r = await http.post(f"/api/sessions/{mine}/cancel")
        assert r.status_code == 404
        r = await http.get(f"/api/sessions/{mine}/stream")
        assert r.status_code == 404
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{mine}/messages")).json()["messages"]
    assert [m["content"] for m in messages if m["role"] == "user"] == ["private"], "nothing was added"


async def test_the_live_turn_is_read_from_the_stream_service(mesh: Mesh) -> None:
    """RunTurn answers `begun` once the turn's messages are stored and its buffer holds `start`, then
    nothing until the turn ends: the caller reads trace:<id> from `start` on, whose deltas arrive,
    paced, before the turn ends; the last answer is the end, with the reply as stored."""
    from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

    mesh.mock.set_rules({"rules": [], "default": {"text": "paced " * 20, "tokens_per_second": 40}})
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        call = mesh.clients.orchestrator.RunTurn(
            orc.RunTurnRequest(agent="general", input="live", chat=orc.ChatCaller())
        )
        first = await call.read()
        begun = first.begun
        assert begun.trace_id and begun.stream_key == trace_key(begun.trace_id), first
        assert begun.start.start.trace_id == begun.trace_id and begun.start.offset, begun
        follow = mesh.clients.follows.follow(begun.stream_key, "")
        rest: list[str] = []
        offsets: list[str] = []
        text_before_end = False
        async with asyncio.timeout(20):
            async for event in follow:
                kind = event.WhichOneof("payload")
                rest.append(kind)
                offsets.append(event.offset)
                if kind == "start":
                    assert event.offset == begun.start.offset and event.start == begun.start.start
                if kind == "text_delta" and not text_before_end:
                    text_before_end = True
                    assert not call.done(), "text arrives while the turn still runs"
                if kind in ("done", "error"):
                    break
            last = await call.read()
            assert await call.read() is grpc.aio.EOF
    ended = last.ended
    assert rest[0] == "start", rest
    assert text_before_end and rest[-2:] == ["finish", "done"], rest
    assert set(rest[1:-2]) == {"text_delta"}, rest
    assert offsets[-2] and offsets[-1] and offsets[-2] != offsets[-1]
    assert ended.end.offset == offsets[-1] and ended.end.HasField("done"), ended
    stored = ended.message
    assert stored.id == begun.start.start.assistant_message_id
    assert stored.status == tp.MESSAGE_STATUS_COMPLETED and stored.content == "paced " * 20
    assert ended.result.content == "paced " * 20 and ended.trace_ref == begun.trace_id


async def _paced_turn(mesh: Mesh, body: dict[str, Any]) -> list[tuple[float, dict[str, Any]]]:
    """A turn at 30 tokens/s over SSE: each event with when it arrived; checks that the text came
    token by token, long before the turn's end, after one `start`."""
    mesh.mock.set_rules({"rules": [], "default": {"text": "tick " * 30, "tokens_per_second": 30}})
    async with mesh.http() as http:
        async with http.stream("POST", "/api/chat", json=body) as resp:
            got: list[tuple[float, dict[str, Any]]] = []
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(20):
                async for event in sse_events(resp):
                    got.append((loop.time(), event))
    kinds = [e["type"] for _, e in got]
    assert kinds[0] == "start" and kinds.count("start") == 1 and kinds[-2:] == ["finish", "done"], kinds
    deltas = [t for t, e in got if e["type"] == "text-delta"]
    assert len(deltas) >= 10, "paced tokens arrive one by one, not as one block"
    assert got[-1][0] - deltas[0] > 0.5, "the first text came long before the turn's end"
    assert "".join(e["textDelta"] for _, e in got if e["type"] == "text-delta") == "tick " * 30
    return got


async def test_paced_reply_streams_over_sse_before_the_turn_ends(mesh: Mesh) -> None:
    await _paced_turn(mesh, {"agent": "general", "message": "pace"})


async def test_a_paced_turn_of_an_existing_session_streams_before_it_ends(mesh: Mesh) -> None:
    """A session's next turn (its buffer created first, then BeginTurn, which puts `start` in it):
    `start` names the session and the placeholder the reply is stored in, and the text streams at the
    model's pace before the turn ends."""
    mesh.mock.set_rules(ECHO)
    session = (await chat(mesh, "general", "first"))[0]["traceId"]
    got = await _paced_turn(mesh, {"agent": "general", "message": "again", "sessionId": session})
    start = got[0][1]
    assert start["traceId"] == session, start
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    last_two = [(m["role"], m["status"]) for m in messages[-2:]]
    assert last_two == [("user", "completed"), ("assistant", "completed")], last_two
    assert messages[-1]["id"] == start["assistantMessageId"] and messages[-1]["content"] == "tick " * 30


async def test_a_buffer_ended_between_the_write_back_and_the_close(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Someone ends the buffer after the reply is stored, before the turn's own close (`finish` and
    `done` in one call): that call appends nothing after the end, the buffer keeps the one terminal
    event it got, and the reply stays stored."""
    from agentmesh.events.v1 import events_pb2 as ev
    from agentmesh.libs import events
    from agentmesh.services.orchestrator.turns import TurnEngine
    from tests.mesh import read_buffer

    mesh.mock.set_rules({"rules": [], "default": {"text": "ended " * 10, "tokens_per_second": 100}})
    finish = TurnEngine._finish
    ended: list[str] = []

    async def ended_first(self: TurnEngine, turn: Any, begun: Any, result: Any) -> ev.Event:
        cut = ev.StreamError(code=ev.ERROR_CODE_CANCELLED, message="ended elsewhere")
        ended.append(turn.stream_key)  # (the turn's watcher may cancel it as soon as the close is out)
        await self.clients.stream.CloseStream(ss.CloseStreamRequest(key=turn.stream_key, error=cut))
        return await finish(self, turn, begun, result)

    monkeypatch.setattr(TurnEngine, "_finish", ended_first)
    got = await chat(mesh, "general", "cut short", timeout=20)
    monkeypatch.undo()
    assert len(ended) == 1 and got[-1]["type"] == "error", ([e["type"] for e in got], got[-3:])
    buffered = await read_buffer(mesh, ended[0])
    kinds = [events.kind(e) for e in buffered]
    assert kinds[0] == "start" and kinds[-1] == "error" and "finish" not in kinds, kinds
    assert buffered[-1].error.message == "ended elsewhere"
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        reply = await mesh.clients.messages.GetMessage(
            ms.GetMessageRequest(message_id=buffered[0].start.assistant_message_id)
        )
    assert (reply.message.status, reply.message.content) == (tp.MESSAGE_STATUS_COMPLETED, "ended " * 10)


async def test_a_turn_whose_buffer_was_replaced_leaves_the_new_one_alone(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The turn's buffer is gone and the key holds a newer turn's buffer (an in-memory stream service
    restarted and the next turn made the key again) when the turn ends: its `finish` and `done` name
    its own buffer (the `start`'s offset), so they are refused (and so is the close of its failure
    path), the newer buffer stays open and empty for its own turn, and the reply stored before
    stays."""
    from agentmesh.events.v1 import events_pb2 as ev
    from agentmesh.services.orchestrator.turns import TurnEngine

    mesh.mock.set_rules({"rules": [], "default": {"text": "mine " * 10, "tokens_per_second": 100}})
    finish = TurnEngine._finish
    replaced: list[str] = []

    async def replaced_first(self: TurnEngine, turn: Any, begun: Any, result: Any) -> ev.Event:
        key = turn.stream_key
        replaced.append(key)
        with identity.acting_as(mesh.user):  # the next turn of the session, as its user
            lost = ev.StreamError(code=ev.ERROR_CODE_INTERRUPTED, message="lost")  # (what its readers get)
            await self.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=lost))
            await self.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        return await finish(self, turn, begun, result)

    monkeypatch.setattr(TurnEngine, "_finish", replaced_first)
    hold_the_watcher(monkeypatch)  # the old buffer's close is not what ends the turn: its refused writes are
    got = await chat(mesh, "general", "replaced", timeout=20)
    monkeypatch.undo()
    assert len(replaced) == 1 and got[-1]["type"] == "error", ([e["type"] for e in got], got[-3:])
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        newer = await mesh.clients.stream.GetStreamInfo(ss.GetStreamInfoRequest(key=replaced[0]))
        placeholder = await mesh.clients.messages.GetMessage(
            ms.GetMessageRequest(message_id=got[0]["assistantMessageId"])
        )
    assert newer.exists and not newer.closed and newer.length == 0, newer  # no finish, no done, no error
    reply = (placeholder.message.status, placeholder.message.content)
    assert reply == (tp.MESSAGE_STATUS_COMPLETED, "mine " * 10), reply  # stored before: it stays


def hold_the_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """The turn's watcher of its buffer never sees a close (it waits until the turn ends): only the
    turn's own refused writes can tell it that its buffer was ended elsewhere."""
    from agentmesh.services.orchestrator.turns import TurnEngine

    async def held(self: TurnEngine, key: str, call: Any, ended: Any) -> None:
        await asyncio.Event().wait()  # (cancelled with the turn's end)

    monkeypatch.setattr(TurnEngine, "_watch", held)


async def test_a_turn_cancelled_before_its_run_ends_cancelled(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another replica cancels the turn right after it began, before its run wrote anything: the run's
    first write is refused, and the turn ends as the close said, whether or not its watcher saw the
    close first (here it does not: it is held). The reader gets `start` and the one terminal
    `cancelled`; the placeholder is marked cancelled, not failed."""
    from agentmesh.events.v1 import events_pb2 as ev
    from agentmesh.services.orchestrator.turns import TurnEngine

    mesh.mock.set_rules(ECHO)
    begin = TurnEngine.begin
    cut: list[str] = []

    async def cancelled_first(self: TurnEngine, turn: Any) -> Any:
        begun = await begin(self, turn)
        if not cut:
            cut.append(turn.stream_key)
            error = ev.StreamError(code=ev.ERROR_CODE_CANCELLED, message="cancelled elsewhere")
            await self.clients.stream.CloseStream(ss.CloseStreamRequest(key=turn.stream_key, error=error))
        return begun

    monkeypatch.setattr(TurnEngine, "begin", cancelled_first)
    hold_the_watcher(monkeypatch)
    got = await chat(mesh, "general", "cut before the run", timeout=20)
    monkeypatch.undo()
    assert [e["type"] for e in got] == ["start", "error"], got
    assert got[-1]["code"] == "cancelled", got[-1]
    assert len(cut) == 1, cut
    trace_id = parse_stream_key(cut[0]).id
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        listed = await mesh.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=trace_id))
    placeholder = [m for m in listed.messages if m.role == tp.MESSAGE_ROLE_ASSISTANT]
    assert [m.status for m in placeholder] == [tp.MESSAGE_STATUS_CANCELLED], listed.messages
    assert placeholder[0].metadata["error"]["code"] == "cancelled", placeholder[0].metadata


async def test_a_turn_closed_elsewhere_mid_reply_at_a_model_pace_ends_cancelled(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At 20 tokens/s, another replica closes the buffer with `cancelled` once the reader has the first
    text, while the turn's watcher is held (so only the run's refused write tells the turn): the reader
    gets the text before the end and then the one terminal `cancelled`; the placeholder is marked
    cancelled and keeps exactly the text the reader got."""
    from agentmesh.events.v1 import events_pb2 as ev

    mesh.mock.set_rules({"rules": [], "default": {"text": "step " * 40, "tokens_per_second": 20}})

    hold_the_watcher(monkeypatch)
    assert mesh.clients is not None
    got: list[dict[str, Any]] = []
    async with (
        mesh.http(timeout=30) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "closed mid-reply"}) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        async with asyncio.timeout(20):
            async for event in sse_events(resp):
                got.append(event)
                if event["type"] == "text-delta" and sum(e["type"] == "text-delta" for e in got) == 1:
                    cut = ev.StreamError(code=ev.ERROR_CODE_CANCELLED, message="cancelled elsewhere")
                    key = trace_key(got[0]["traceId"])
                    with identity.acting_as(mesh.user):
                        await mesh.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=cut))
    monkeypatch.undo()
    kinds = [e["type"] for e in got]
    assert kinds[0] == "start" and "text-delta" in kinds and kinds[-1] == "error", kinds
    assert got[-1]["code"] == "cancelled" and kinds.count("error") == 1, got[-1]
    text = "".join(e["textDelta"] for e in got if e["type"] == "text-delta")
    assert 0 < len(text) < len("step " * 40), text  # the end came long before the reply's
    with identity.acting_as(mesh.user):
        reply = await mesh.clients.messages.GetMessage(
            ms.GetMessageRequest(message_id=got[0]["assistantMessageId"])
        )
    assert reply.message.status == tp.MESSAGE_STATUS_CANCELLED, reply.message
    assert reply.message.content == text, (reply.message.content, text)
