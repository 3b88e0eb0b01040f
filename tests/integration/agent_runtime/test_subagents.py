"""Session subagents end to end
(docs/requirements.md#session-subagents): concurrency, anchors, restore, config priority, tool
visibility, failure isolation, HTTP = WebSocket, cascade delete, cancellation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets
from google.protobuf import field_mask_pb2
from sqlalchemy import text

from agentmesh.events.v1 import events_pb2 as ev_pb
from agentmesh.libs import events as events_of
from agentmesh.libs import identity
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.ids import subagent_key
from agentmesh.services.trace.store.sql.db import create_engine
from agentmesh.services.trace.store.sql.messages import SqlMessageStore
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.mesh import (
    BACKENDS,
    TEST_CATALOG,
    Mesh,
    chat,
    read_buffer,
    sse_events,
    system_of,
    wait_until,
)

GLOBAL = SubagentDefaults(max_concurrent=3, timeout_ms=20000)
SUMMARY_DONE = {"total": 5, "completed": 5, "running": 0, "failed": 0, "cancelled": 0}


def fan_out(tasks: list[dict[str, Any]], trigger: str = "fan out") -> list[dict[str, Any]]:
    return [
        {
            "system": r"\[general\]|\[defaults\]|\[solo\]",
            "user": trigger,
            "after_tool": False,
            "tool_calls": [{"name": "delegate_parallel", "arguments": {"tasks": tasks}}],
        },
    ]


BASE_RULES: list[dict[str, Any]] = [
    {
        "system": r"\[general\]",
        "user": "delegate one",
        "after_tool": False,
        "tool_calls": [
            {"name": "delegate_task", "arguments": {"goal": "write a haiku", "agentSlug": "coder"}}
        ],
    },
    {
        "system": r"\[general\]",
        "user": "ask clone",
        "after_tool": False,
        "tool_calls": [{"name": "delegate_task", "arguments": {"goal": "think alone", "mode": "clone"}}],
    },
    {"system": r"\[(general|defaults|solo)\]", "after_tool": True, "text": "All done: {tool_results}"},
    {
        "system": r"\[coder\]",
        "barrier": 2,
        "barrier_timeout_ms": 400,
        "ttft_ms": 20,
        "text": "code for {user}",
    },
    {
        "system": r"\[helper\]",
        "user": "ask the user",
        "require_tools": False,
        "after_tool": False,
        "tool_calls": [{"name": "clarify", "arguments": {"question": "which one?"}}],
    },
    {"system": r"\[helper\]", "text": "helped with {user}"},
    {"system": r"\[slow\]", "fault": "stall_before"},
    {"system": r"\[broken\]", "fault": "http_500"},
    {"system": r"You are a subagent", "text": "clone result for {user}"},
]
DEFAULT = {"text": "plain answer"}


def rules(*extra: dict[str, Any]) -> dict[str, Any]:
    return {"rules": [*extra, *BASE_RULES], "default": DEFAULT}


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=rules(), catalog=TEST_CATALOG, subagent=GLOBAL)


def subagent_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["type"].startswith("subagent-")]


async def messages(mesh: Mesh, session_id: str) -> list[dict[str, Any]]:
    async with mesh.http() as http:
        resp = await http.get(f"/api/sessions/{session_id}/messages")
    assert resp.status_code == 200, resp.text
    return resp.json()["messages"]


async def test_parallel_batch_respects_max_concurrent(mesh: Mesh) -> None:
    tasks = [{"goal": f"part {i}", "agentSlug": "coder"} for i in range(5)]
    mesh.mock.set_rules(rules(*fan_out(tasks)))
    mesh.mock.reset()
    events = await chat(mesh, "general", "fan out", timeout=40)
    anchor = events[0]["assistantMessageId"]
    subs = subagent_events(events)
    assert subs[0]["type"] == "subagent-batch-start" and subs[0]["total"] == 5
    assert subs[0]["parentMessageId"] == anchor and subs[-1]["type"] == "subagent-done"
    status: dict[str, str] = {}
    peak = 0
    for e in subs:
        if e["type"] == "subagent-update":
            assert e["parentMessageId"] == anchor
            status[e["subagent"]["id"]] = e["subagent"]["status"]
            peak = max(peak, sum(1 for s in status.values() if s == "running"))
    assert peak == 2, "at most maxConcurrent = 2 subagents run at once, and 2 did"
    assert sorted(status.values()) == ["completed"] * 5
    assert subs[-1]["summary"] == SUMMARY_DONE
    assert mesh.mock.stats()["max_in_flight"] == 2
    # Each subagent went queued -> running -> completed.
    per: dict[str, list[str]] = {}
    for e in subs:
        if e["type"] == "subagent-update":
            per.setdefault(e["subagent"]["id"], []).append(e["subagent"]["status"])
    assert all(v == ["queued", "running", "completed"] for v in per.values()), per
    final = "".join(e["textDelta"] for e in events if e["type"] == "text-delta")
    assert all(f"code for part {i}" in final for i in range(5))
    # A row is readable by its owner only; each card's live text is on subagent:<id>.
    assert mesh.clients is not None
    some_id = next(iter(status))
    with identity.acting_as(mesh.user):
        row = await mesh.clients.subagents.GetSubagentSession(
            sbs.GetSubagentSessionRequest(subagent_id=some_id)
        )
    assert row.subagent.status == ev_pb.SUBAGENT_STATUS_COMPLETED and row.subagent.parent_message_id == anchor
    stranger = await mesh.new_user(f"stranger-{some_id}")
    async with mesh.http(api_key=stranger) as http:
        assert (await http.get(f"/api/subagents/{some_id}/stream")).status_code == 404
    done_items = {e["subagent"]["id"]: e["subagent"] for e in subs if e["type"] == "subagent-update"}
    async with mesh.http() as http:
        for sub_id, item in done_items.items():
            async with http.stream("GET", f"/api/subagents/{sub_id}/stream") as resp:
                live = [e async for e in sse_events(resp)]
            assert live[-1]["type"] == "done"
            assert "".join(e["textDelta"] for e in live if e["type"] == "text-delta") == item["summary"]
    # Written back onto the anchor as SubagentBatch[].
    msgs = await messages(mesh, events[0]["traceId"])
    batches = msgs[-1]["metadata"]["subagents"]
    assert len(batches) == 1 and batches[0]["parentMessageId"] == anchor
    assert batches[0]["summary"] == SUMMARY_DONE
    # The stored card is the live card, field by field (one serialiser).
    assert batches[0]["items"] == sorted(done_items.values(), key=lambda i: i["sortOrder"])
    assert [i["sortOrder"] for i in batches[0]["items"]] == [0, 1, 2, 3, 4]
    assert all(
        i["status"] == "completed" and i["summary"].startswith("code for") for i in batches[0]["items"]
    )


async def test_each_turn_anchors_its_own_batch_and_restore_matches_rows(mesh: Mesh) -> None:
    mesh.mock.set_rules(rules())
    session = None
    anchors: dict[int, int] = {}
    for turn in range(1, 6):
        message = "delegate one" if turn in (2, 5) else f"hello {turn}"
        events = await chat(mesh, "general", message, session_id=session)
        session = events[0]["traceId"]
        for e in subagent_events(events):
            assert e["parentMessageId"] == events[0]["assistantMessageId"]
        if turn in (2, 5):
            assert subagent_events(events), f"turn {turn} delegates"
            anchors[turn] = events[0]["assistantMessageId"]
        else:
            assert not subagent_events(events)
    assert session is not None
    msgs = await messages(mesh, session)
    with_batches = {
        m["id"]: m["metadata"]["subagents"] for m in msgs if m.get("metadata", {}).get("subagents")
    }
    assert set(with_batches) == set(anchors.values())
    for anchor, batches in with_batches.items():
        assert [b["parentMessageId"] for b in batches] == [anchor]
    # Delete the metadata in the database; the batches are rebuilt from the rows, identical.
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        for anchor in anchors.values():
            await mesh.clients.messages.UpdateMessage(
                ms.UpdateMessageRequest(
                    message=tp.Message(id=anchor), update_mask=field_mask_pb2.FieldMask(paths=["metadata"])
                )
            )
        raw = await mesh.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=session))
    assert not any("subagents" in m.metadata for m in raw.messages), "metadata really deleted"
    restored = {
        m["id"]: m["metadata"]["subagents"]
        for m in await messages(mesh, session)
        if m.get("metadata", {}).get("subagents")
    }
    assert restored == with_batches


async def test_blocked_tools_never_reach_a_subagent(mesh: Mesh) -> None:
    tasks = [
        {
            "goal": "ask the user",
            "agentSlug": "helper",
            "toolNames": ["clarify", "delegate_task", "agent-invoke", "memory_save"],
        }
    ]
    mesh.mock.set_rules(rules(*fan_out(tasks, "blocked")))
    before = len(mesh.mock.requests())
    events = await chat(mesh, "general", "blocked", timeout=30)
    helper_calls = [b for b in mesh.mock.requests()[before:] if "[helper]" in system_of(b)]
    assert helper_calls, "the helper subagent ran"
    for body in helper_calls:
        offered = {t["function"]["name"] for t in body.get("tools", [])}
        assert offered == {"agent-invoke"}
        assert "You are a subagent" in system_of(body) and "Never ask the user" in system_of(body)
    # Its scripted clarify call fails: subagents cannot ask the user.
    item = next(
        e for e in events if e["type"] == "subagent-update" and e["subagent"]["status"] == "completed"
    )
    sub_msgs = await messages(mesh, item["subagent"]["childTraceId"])
    call = sub_msgs[-1]["metadata"]["toolCalls"][0]
    assert call["name"] == "clarify" and call["ok"] is False and "not available" in call["output"]["error"]
    assert call["output"]["code"] == "permission_denied"
    assert all(m["source"] == "subagent" for m in sub_msgs)
    # An agent with subagents disabled is not shown the delegate tools.
    before = len(mesh.mock.requests())
    await chat(mesh, "solo", "anything")
    offered = {t["function"]["name"] for t in mesh.mock.requests()[before].get("tools", [])}
    assert offered == {"agent-invoke"}


async def test_partial_failure_is_isolated(mesh: Mesh) -> None:
    tasks = [
        {"goal": "slow part", "agentSlug": "slow"},
        {"goal": "broken part", "agentSlug": "broken"},
        {"goal": "good part", "agentSlug": "helper"},
        {"goal": "clone part", "mode": "clone"},
    ]
    mesh.mock.set_rules(rules(*fan_out(tasks, "mixed")))
    events = await chat(mesh, "general", "mixed", timeout=40)
    assert events[-1]["type"] == "done"
    done = next(e for e in events if e["type"] == "subagent-done")
    assert done["summary"] == {"total": 4, "completed": 2, "running": 0, "failed": 2, "cancelled": 0}
    out = next(e for e in events if e["type"] == "tool-output-available")["output"]
    by_goal = {r["goal"]: r for r in out["results"]}
    assert by_goal["slow part"]["status"] == "failed" and by_goal["slow part"]["error"].startswith("timeout")
    assert by_goal["broken part"]["status"] == "failed" and by_goal["broken part"]["error"].startswith(
        "model_error"
    )
    assert by_goal["good part"]["summary"] == "helped with good part"
    assert by_goal["clone part"]["summary"].startswith("clone result for clone part")
    final = "".join(e["textDelta"] for e in events if e["type"] == "text-delta")
    assert "helped with good part" in final and "timeout" in final and "model_error" in final


@pytest.mark.parametrize(
    ("task", "needle"),
    [
        ({"goal": "forbidden", "agentSlug": "secret"}, "not allowed"),
        ({"goal": "ghost", "agentSlug": "nobody-here"}, "unknown preset agent 'nobody-here'"),
        ({"goal": "odd", "mode": "twin"}, "mode must be preset or clone"),
    ],
)
async def test_a_batch_that_cannot_run_fails_fast_and_creates_nothing(
    mesh: Mesh, task: dict[str, Any], needle: str
) -> None:
    tasks = [{"goal": "good part", "agentSlug": "helper"}, task]
    mesh.mock.set_rules(rules(*fan_out(tasks, "refused batch")))
    events = await chat(mesh, "general", "refused batch", timeout=30)
    assert events[-1]["type"] == "done", "the supervisor's turn goes on"
    assert not subagent_events(events), "no card for a batch that never started"
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and out["output"]["code"] == "invalid_argument"
    assert out["output"]["error"].startswith("task 2: ") and needle in out["output"]["error"]
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        rows = await mesh.clients.subagents.ListSubagentSessions(
            sbs.ListSubagentSessionsRequest(trace_id=events[0]["traceId"])
        )
    assert list(rows.subagents) == [], "no row, no hidden trace"


async def test_http_and_websocket_give_the_same_events(mesh: Mesh) -> None:
    same = [
        {
            "system": r"\[general\]",
            "user": "delegate same",
            "after_tool": False,
            "tool_calls": [
                {"name": "delegate_task", "arguments": {"goal": "write a haiku", "agentSlug": "coder"}}
            ],
        },
        {
            "system": r"\[general\]",
            "user": "delegate same",
            "after_tool": True,
            "text": "The haiku is written.",
        },
    ]
    mesh.mock.set_rules(rules(*same))
    sse = await chat(mesh, "general", "delegate same")
    url = mesh.url.replace("http://", "ws://") + "/api/ws"
    async with websockets.connect(url, additional_headers={"Authorization": f"Bearer {mesh.api_key}"}) as ws:
        await ws.send(json.dumps({"type": "chat", "agent": "general", "message": "delegate same"}))
        got: list[dict[str, Any]] = []
        async with asyncio.timeout(30):
            while not got or got[-1]["type"] not in ("done", "error"):
                got.append(json.loads(await ws.recv()))
    varying = {
        "_id",
        "offset",
        "traceId",
        "userMessageId",
        "assistantMessageId",
        "parentMessageId",
        "toolCallId",
        "id",
        "durationMs",
        "subagentIds",
        "taskId",
        "childTraceId",
    }

    def norm(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items() if k not in varying}
        if isinstance(value, list):
            return [norm(v) for v in value]
        return value

    # A reader that falls behind gets consecutive text deltas merged (the same text, cut otherwise):
    # the text is compared whole, every other event one by one.
    def text(events: list[dict[str, Any]]) -> str:
        return "".join(e["textDelta"] for e in events if e["type"] == "text-delta")

    def others(events: list[dict[str, Any]]) -> list[Any]:
        return norm([e for e in events if e["type"] != "text-delta"])

    assert text(got) == text(sse) != ""
    assert others(got) == others(sse)
    assert "subagent-batch-start" in [e["type"] for e in got]


async def test_delete_cascade_leaves_no_rows(mesh: Mesh) -> None:
    mesh.mock.set_rules(rules())
    events = await chat(mesh, "general", "delegate one")
    session = events[0]["traceId"]
    item = next(e for e in events if e["type"] == "subagent-update")["subagent"]
    engine = create_engine(mesh.settings.sqlalchemy_url)
    try:
        async with engine.connect() as conn:
            q = "SELECT count(*) FROM subagent_sessions WHERE trace_id = :s"
            assert (await conn.execute(text(q), {"s": session})).scalar() == 1
        async with mesh.http() as http:
            resp = await http.delete(f"/api/sessions/{session}")
            assert (resp.status_code, resp.json()) == (200, {"deleted": True})
        async with engine.connect() as conn:
            for sql, arg in [
                ("SELECT count(*) FROM subagent_sessions WHERE trace_id = :s", session),
                ("SELECT count(*) FROM traces WHERE id = :s", session),
                ("SELECT count(*) FROM traces WHERE id = :s", item["childTraceId"]),
                ("SELECT count(*) FROM messages WHERE trace_id = :s", item["childTraceId"]),
                ("SELECT count(*) FROM messages WHERE trace_id = :s", session),
            ]:
                assert (await conn.execute(text(sql), {"s": arg})).scalar() == 0, sql
    finally:
        await engine.dispose()


async def test_cancel_mid_batch_cancels_every_subagent(mesh: Mesh) -> None:
    tasks = [{"goal": f"wait {i}", "agentSlug": "coder"} for i in range(3)]
    stall = {"system": r"\[coder\]", "user": "^wait", "fault": "stall_before"}
    mesh.mock.set_rules(rules(*fan_out(tasks, "hang"), stall))
    async with (
        mesh.http(timeout=30) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "hang"}) as resp,
    ):
        got: list[dict[str, Any]] = []
        stream = sse_events(resp)
        async with asyncio.timeout(20):
            running = 0
            async for event in stream:
                got.append(event)
                if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                    running += 1
                    if running == 2:
                        break
            r = await http.post(f"/api/sessions/{got[0]['traceId']}/cancel")
            assert r.json() == {"cancelled": True}
            async for event in stream:
                got.append(event)
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled"
    assert mesh.clients is not None

    async def all_cancelled() -> bool:
        with identity.acting_as(mesh.user):
            rows = await mesh.clients.subagents.ListSubagentSessions(  # type: ignore[union-attr]
                sbs.ListSubagentSessionsRequest(trace_id=got[0]["traceId"])
            )
        return len(rows.subagents) == 3 and all(
            r.status == ev_pb.SUBAGENT_STATUS_CANCELLED for r in rows.subagents
        )

    await wait_until(all_cancelled, 10, "every subagent cancelled")
    await mesh.mock.wait_idle(timeout=10)
    with identity.acting_as(mesh.user):
        rows = await mesh.clients.subagents.ListSubagentSessions(
            sbs.ListSubagentSessionsRequest(trace_id=got[0]["traceId"])
        )

    async def settled(row: Any) -> bool:
        with identity.acting_as(mesh.user):
            child = await mesh.clients.messages.ListMessages(  # type: ignore[union-attr]
                ms.ListMessagesRequest(trace_id=row.child_trace_id, mode=ms.PATH_MODE_ALL)
            )
        want = [tp.MESSAGE_STATUS_COMPLETED, tp.MESSAGE_STATUS_CANCELLED]
        return [m.status for m in child.messages] == want

    for row in rows.subagents:
        # A running child's turn settles in the orchestrator as its RunTurn call is cancelled, which
        # the batch does not wait for; the one still queued never ran, and settles before its row.
        await wait_until(lambda row=row: settled(row), 10, f"{row.id} settled")
        last = (await read_buffer(mesh, subagent_key(row.id)))[-1]
        assert last.error.code == ev_pb.ERROR_CODE_CANCELLED, row.id


async def test_agents_route_shows_effective_config(mesh: Mesh) -> None:
    async with mesh.http() as http:
        agents = {a["slug"]: a for a in (await http.get("/api/agents")).json()["agents"]}
    effective = {slug: a["effectiveSubagentConfig"] for slug, a in agents.items()}
    assert effective["general"]["maxConcurrent"] == 2  # the agent's own override
    assert effective["defaults"]["maxConcurrent"] == 3  # the mesh's global default
    assert effective["solo"]["enabled"] is False
    assert effective["general"]["allowedPresetAgentIds"] == ["coder", "helper", "slow", "broken"]
    assert "allowedPresetAgentIds" not in effective["defaults"], "not configured: any preset"
    assert agents["general"]["invoke"]["allowedCallees"][:2] == ["coder", "slow"]


async def only_row(mesh: Mesh, trace_id: str) -> Any:
    """The one subagent row of a turn's trace."""
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        request = sbs.ListSubagentSessionsRequest(trace_id=trace_id)
        (row,) = (await mesh.clients.subagents.ListSubagentSessions(request)).subagents
    return row


def is_subagent_turn(messages: Any) -> bool:
    return bool(messages) and messages[0].source == tp.MESSAGE_SOURCE_SUBAGENT


async def test_a_subagent_turn_is_stored_with_its_row_and_runs_at_once(
    mesh: Mesh, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subagent's user message and placeholder are stored with its row (CreateSubagentSessions) and
    its buffer is born with its `start`: the child turn stores nothing more before its run (no
    BeginTurn), its reply lands on that placeholder, and `start` names both messages."""
    mesh.mock.set_rules(rules(*fan_out([{"goal": "early part", "agentSlug": "helper"}], "early child")))
    begun: list[Any] = []
    stored, created = SqlMessageStore.append_messages, SqlMessageStore.create_trace_with_messages

    async def appending(self: SqlMessageStore, owner: str, trace_id: str, msgs: Any, parent: Any) -> Any:
        if is_subagent_turn(msgs):
            begun.append(trace_id)
        return await stored(self, owner, trace_id, msgs, parent)

    async def creating(self: SqlMessageStore, owner: str, trace: Any, trace_id: str, msgs: Any) -> Any:
        if is_subagent_turn(msgs):
            begun.append(trace_id)
        return await created(self, owner, trace, trace_id, msgs)

    monkeypatch.setattr(SqlMessageStore, "append_messages", appending)
    monkeypatch.setattr(SqlMessageStore, "create_trace_with_messages", creating)
    events = await chat(mesh, "general", "early child", timeout=30)
    monkeypatch.undo()
    assert begun == [], "the child's turn was stored with its row"
    assert events[-1]["type"] == "done"
    out = next(e for e in events if e["type"] == "tool-output-available")["output"]
    assert [r["status"] for r in out["results"]] == ["completed"], out
    assert out["results"][0]["summary"] == "helped with early part"
    row = await only_row(mesh, events[0]["traceId"])
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        child = await mesh.clients.messages.ListMessages(
            ms.ListMessagesRequest(trace_id=row.child_trace_id, mode=ms.PATH_MODE_MAIN_PATH)
        )
    assert [(m.role, m.status, m.content, m.source, m.caller_agent) for m in child.messages] == [
        (
            tp.MESSAGE_ROLE_USER,
            tp.MESSAGE_STATUS_COMPLETED,
            "early part",
            tp.MESSAGE_SOURCE_SUBAGENT,
            "general",
        ),
        (
            tp.MESSAGE_ROLE_ASSISTANT,
            tp.MESSAGE_STATUS_COMPLETED,
            "helped with early part",
            tp.MESSAGE_SOURCE_SUBAGENT,
            "general",
        ),
    ]
    buffered = await read_buffer(mesh, subagent_key(row.id))
    kinds = [events_of.kind(e) for e in buffered]
    assert kinds[0] == "start" and kinds[-2:] == ["finish", "done"], kinds
    start = buffered[0].start
    assert (start.trace_id, start.user_message_id, start.assistant_message_id) == (
        row.child_trace_id,
        child.messages[0].id,
        child.messages[1].id,
    )
