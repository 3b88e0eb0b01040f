"""agent-invoke end to end (docs/requirements.md#agent-invoke-streaming, #one-invoke-engine): live callee
streams, provenance, errors, recursion,
cancellation down the tree, continueFrom; on SQLite + memory and PostgreSQL + Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.protobuf import field_mask_pb2

from agentmesh.libs import events as evlib
from agentmesh.libs import identity
from agentmesh.libs.ids import a2a_key
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.mesh import (
    BACKENDS,
    TEST_CATALOG,
    Mesh,
    chat,
    sse_events,
    system_of,
    wait_request,
    wait_until,
)

RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": r"continue (?P<trace>\S+) (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "agent-invoke",
                    "arguments": {"agentSlug": "coder", "input": "{rest}", "continueFrom": "{trace}"},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": r"invoke-both (?P<slug>[\w-]+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "agent-invoke",
                    "arguments": {"agentSlug": "{slug}", "input": ["{rest} one", "{rest} two"]},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": r"invoke (?P<slug>[\w-]+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "{slug}", "input": "{rest}"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "Result: {tool_results}"},
        {"system": r"\[coder\]", "text": "def add(a, b):\n    return a + b  # for {user}"},
        {"system": r"\[slow\]", "fault": "stall_before"},
        {"system": r"\[broken\]", "fault": "http_500"},
        {"system": r"\[loop-b\]", "user": "stallnow", "fault": "stall"},
        {
            "system": r"\[loop-a\]",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "loop-b", "input": "{user}"}}],
        },
        {
            "system": r"\[loop-b\]",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "loop-a", "input": "{user}"}}],
        },
        {"system": r"\[loop-[ab]\]", "after_tool": True, "text": "loop done: {tool_results}"},
    ],
    "default": {"text": "default reply"},
}


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=TEST_CATALOG)


@pytest.fixture(autouse=True)
def rules(mesh: Mesh) -> None:
    mesh.mock.set_rules(RULES)


async def tasks_of(mesh: Mesh, session_id: str) -> list[tp.A2ATask]:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.tasks.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=session_id))
    return list(resp.tasks)


async def messages_of(mesh: Mesh, trace_id: str) -> list[tp.Message]:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.messages.ListMessages(
            ms.ListMessagesRequest(trace_id=trace_id, mode=ms.PATH_MODE_ALL)
        )
    return list(resp.messages)


async def buffer(mesh: Mesh, key: str) -> list[dict[str, Any]]:
    """Everything in a (closed) buffer, read through the stream service."""
    assert mesh.clients is not None
    out = []
    with identity.acting_as(mesh.user):
        follow = mesh.clients.follows.follow(key)
    async with asyncio.timeout(10):
        async for event in follow:
            out.append(evlib.to_dict(event))
    return out


def kinds(events: list[dict[str, Any]]) -> list[str]:
    return [e["type"] for e in events]


async def test_general_invokes_coder_live_and_persisted(mesh: Mesh) -> None:
    async with mesh.http() as http:
        before = (await http.get("/api/sessions")).json()["sessions"]
    events = await chat(mesh, "general", "invoke coder: write add")
    k = kinds(events)
    i_in, i_started, i_out = (
        k.index("tool-input-available"),
        k.index("a2a-task-started"),
        k.index("tool-output-available"),
    )
    assert i_in < i_started < i_out, k
    started = events[i_started]
    assert started["calleeAgentSlug"] == "coder" and started["calleeAgentName"] == "Coding Assistant"
    assert started["toolCallId"] == events[i_in]["toolCallId"]
    out = events[i_out]
    assert out["ok"] is True
    assert out["output"]["ok"] is True and out["output"]["taskId"] == started["taskId"]
    assert "def add" in out["output"]["output"]
    assert out["metadata"]["taskId"] == started["taskId"]
    assert out["metadata"]["recursionDepth"] == 1 and out["metadata"]["durationMs"] >= 0
    final = "".join(e["textDelta"] for e in events if e["type"] == "text-delta")
    assert final.startswith("Result: ") and "def add" in final

    # A late subscriber on the callee stream gets the whole reply, then done.
    task_id = started["taskId"]
    async with mesh.http() as http, http.stream("GET", f"/api/agents/a2a/stream?taskId={task_id}") as resp:
        assert resp.status_code == 200
        late = [e async for e in sse_events(resp)]
    assert kinds(late)[-1] == "done"
    callee_text = "".join(e["textDelta"] for e in late if e["type"] == "text-delta")
    assert callee_text == out["output"]["output"]

    # Persisted: the task, its hidden session and the callee messages with provenance and usage.
    session_id = events[0]["traceId"]
    tasks = await tasks_of(mesh, session_id)
    assert [t.id for t in tasks] == [task_id]
    task = tasks[0]
    assert (
        task.state == tp.TASK_STATE_COMPLETED
        and task.callee_agent == "coder"
        and task.caller_agent == "general"
    )
    assert task.visible_in_sidebar is False
    msgs = await messages_of(mesh, task.trace_id)
    assert [m.role for m in msgs] == [tp.MESSAGE_ROLE_USER, tp.MESSAGE_ROLE_ASSISTANT]
    for m in msgs:
        assert m.source == tp.MESSAGE_SOURCE_A2A and m.a2a_task_id == task_id
        assert m.caller_agent == "general" and m.caller_trace_id == session_id
    assert msgs[0].content == "write add"
    assert msgs[1].content == callee_text and msgs[1].model == "mock-gpt"
    assert msgs[1].usage.input_tokens > 0 and msgs[1].usage.output_tokens > 0

    # The session list gained only the caller's chat session, never the hidden callee session.
    async with mesh.http() as http:
        after = (await http.get("/api/sessions")).json()["sessions"]
        ids = [s["id"] for s in after]
        assert session_id in ids and task.trace_id not in ids
        assert len(after) == len(before) + 1
        # The caller's trace shows the tool call and its result; the callee trace is readable by its owner.
        caller = (await http.get(f"/api/sessions/{session_id}/messages")).json()["messages"]
        calls = caller[-1]["metadata"]["toolCalls"]
        assert calls[0]["name"] == "agent-invoke" and calls[0]["output"]["taskId"] == task_id
        callee = await http.get(f"/api/sessions/{task.trace_id}/messages")
        assert callee.status_code == 200 and len(callee.json()["messages"]) == 2
        # Another user can read neither the callee trace nor the task stream.
        other = await mesh.new_user("mallory")
    async with mesh.http(api_key=other) as http:
        assert (await http.get(f"/api/sessions/{task.trace_id}/messages")).status_code == 404
        assert (await http.get(f"/api/agents/a2a/stream?taskId={task_id}")).status_code == 404


async def test_stream_routes_without_a_buffer(mesh: Mesh) -> None:
    """No buffer: the owner hears `no-buffer`; anyone else, and any unknown id, gets 404 (no probing)."""
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        trace = tp.Trace(agent="general")
        session = (await mesh.clients.trace.CreateTrace(ts.CreateTraceRequest(trace=trace))).trace
        task = (
            await mesh.clients.tasks.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_agent="general", caller_trace_id=session.id)
                )
            )
        ).task
    other = await mesh.new_user("eve")
    no_buffer = {"active": False, "reason": "no-buffer"}
    for path in (f"/api/sessions/{session.id}/stream", f"/api/agents/a2a/stream?taskId={task.id}"):
        async with mesh.http() as http:
            resp = await http.get(path)
            assert (resp.status_code, resp.json()) == (200, no_buffer)
        async with mesh.http(api_key=other) as http:
            resp = await http.get(path)
            assert resp.status_code == 404 and resp.json()["error"]["reason"] == "NOT_FOUND"
    async with mesh.http() as http:
        for path in (
            "/api/sessions/nope/stream",
            "/api/agents/a2a/stream?taskId=nope",
            "/api/subagents/0123456789abcdef01234567/stream",
        ):
            assert (await http.get(path)).status_code == 404


async def test_a2a_session_visible_in_sidebar_is_listed(mesh: Mesh) -> None:
    events = await chat(mesh, "general", "invoke coder: show me")
    task = (await tasks_of(mesh, events[0]["traceId"]))[0]
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        await mesh.clients.trace.UpdateTrace(
            ts.UpdateTraceRequest(
                trace=tp.Trace(id=task.trace_id, visible_in_sidebar=True),
                update_mask=field_mask_pb2.FieldMask(paths=["visible_in_sidebar"]),
            )
        )
    async with mesh.http() as http:
        ids = [s["id"] for s in (await http.get("/api/sessions")).json()["sessions"]]
    assert task.trace_id in ids


async def test_list_input_runs_two_tasks(mesh: Mesh) -> None:
    events = await chat(mesh, "general", "invoke-both coder: task")
    started = [e for e in events if e["type"] == "a2a-task-started"]
    assert len(started) == 2 and started[0]["taskId"] != started[1]["taskId"]
    out = next(e for e in events if e["type"] == "tool-output-available")
    results = out["output"]["results"]
    assert [r["ok"] for r in results] == [True, True]
    assert sorted(out["metadata"]["taskIds"]) == sorted(s["taskId"] for s in started)
    tasks = await tasks_of(mesh, events[0]["traceId"])
    assert {t.state for t in tasks} == {tp.TASK_STATE_COMPLETED} and len(tasks) == 2
    for s in started:
        buf = await buffer(mesh, a2a_key(s["taskId"]))
        assert kinds(buf)[0] == "start" and kinds(buf)[-1] == "done"


@pytest.mark.parametrize(
    ("callee", "code"),
    [("slow", "timeout"), ("broken", "model_error")],
)
async def test_callee_failure_fails_task_and_turn_goes_on(mesh: Mesh, callee: str, code: str) -> None:
    events = await chat(mesh, "general", f"invoke {callee}: do it", timeout=40)
    started = next(e for e in events if e["type"] == "a2a-task-started")
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and out["output"]["ok"] is False and out["output"]["code"] == code
    if callee == "slow":  # the callee's own limit (1500 ms), never "0 ms" when the caller sets none
        assert out["output"]["error"] == "agent slow did not finish within 1500 ms", out["output"]
    assert out["output"]["taskId"] == started["taskId"]
    assert kinds(events)[-2:] == ["finish", "done"], "the caller's turn goes on"
    assert "Result:" in "".join(e["textDelta"] for e in events if e["type"] == "text-delta")
    task = (await tasks_of(mesh, events[0]["traceId"]))[0]
    assert task.state == tp.TASK_STATE_FAILED
    buf = await buffer(mesh, a2a_key(task.id))
    assert buf[-1]["type"] == "error" and buf[-1]["code"] == code
    msgs = await messages_of(mesh, task.trace_id)
    assert msgs[-1].status == tp.MESSAGE_STATUS_FAILED


@pytest.mark.parametrize(
    ("callee", "needle", "code"),
    [("ghost", "unknown agent", "not_found"), ("secret", "may not call", "permission_denied")],
)
async def test_refused_callee_creates_nothing(mesh: Mesh, callee: str, needle: str, code: str) -> None:
    events = await chat(mesh, "general", f"invoke {callee}: hi")
    assert "a2a-task-started" not in kinds(events)
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and needle in out["output"]["error"] and out["output"]["code"] == code
    assert await tasks_of(mesh, events[0]["traceId"]) == []


async def test_recursion_stops_at_the_limit(mesh: Mesh) -> None:
    # general -> loop-a (depth 1) -> loop-b (2) -> loop-a (3) -> loop-b would be 4 > 3: refused.
    events = await chat(mesh, "general", "invoke loop-a: spin", timeout=40)
    assert kinds(events)[-1] == "done"
    session = events[0]["traceId"]
    chain = []
    for _ in range(5):
        tasks = await tasks_of(mesh, session)
        if not tasks:
            break
        assert len(tasks) == 1 and tasks[0].state == tp.TASK_STATE_COMPLETED
        chain.append(tasks[0])
        session = tasks[0].trace_id
    assert [t.callee_agent for t in chain] == ["loop-a", "loop-b", "loop-a"]
    deepest = await messages_of(mesh, chain[-1].trace_id)
    meta = deepest[-1].metadata
    refused = meta["toolCalls"][0]
    assert refused["ok"] is False and "recursion depth 4 exceeds" in refused["output"]["error"]
    assert refused["output"]["code"] == "depth_exceeded"
    buf = await buffer(mesh, a2a_key(chain[-1].id))
    assert "a2a-task-started" not in kinds(buf)


async def test_cancel_goes_down_the_tree(mesh: Mesh) -> None:
    before = len(mesh.mock.requests())
    async with (
        mesh.http(timeout=30) as http,
        http.stream(
            "POST", "/api/chat", json={"agent": "general", "message": "invoke loop-a: stallnow"}
        ) as resp,
    ):
        got: list[dict[str, Any]] = []
        stream = sse_events(resp)
        async with asyncio.timeout(20):
            async for event in stream:
                got.append(event)
                if event["type"] == "a2a-task-started":
                    break
            # Wait until the leaf (loop-b) is streaming from the model server.
            await wait_request(mesh.mock, lambda b: "[loop-b]" in system_of(b), timeout=10, start=before)
            r = await http.post(f"/api/sessions/{got[0]['traceId']}/cancel")
            assert r.status_code == 200 and r.json() == {"cancelled": True}
            async for event in stream:
                got.append(event)
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled"
    session = got[0]["traceId"]
    top = (await tasks_of(mesh, session))[0]

    async def tree_cancelled() -> bool:
        first = await tasks_of(mesh, session)
        second = await tasks_of(mesh, first[0].trace_id)
        return bool(second) and all(t.state == tp.TASK_STATE_CANCELED for t in first + second)

    await wait_until(tree_cancelled, 10, "every task of the tree cancelled")
    leaf = (await tasks_of(mesh, top.trace_id))[0]
    for task in (top, leaf):
        buf = await buffer(mesh, a2a_key(task.id))
        assert buf[-1]["type"] == "error" and buf[-1]["code"] == "cancelled"
    await mesh.mock.wait_idle(timeout=10)  # no run keeps streaming from the model
    async with mesh.http() as http:
        msgs = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    assert msgs[-1]["status"] == "cancelled"


async def test_continue_from_sees_the_earlier_call(mesh: Mesh) -> None:
    first = await chat(mesh, "general", "invoke coder: first question")
    out = next(e for e in first if e["type"] == "tool-output-available")["output"]
    trace_id = out["traceId"]
    before = len(mesh.mock.requests())
    second = await chat(mesh, "general", f"continue {trace_id} second question")
    out2 = next(e for e in second if e["type"] == "tool-output-available")["output"]
    assert out2["ok"] is True and out2["traceId"] == trace_id and out2["taskId"] != out["taskId"]
    coder_calls = [b for b in mesh.mock.requests()[before:] if "[coder]" in system_of(b)]
    assert len(coder_calls) == 1
    sent = [(m["role"], m.get("content")) for m in coder_calls[0]["messages"][1:]]
    assert (
        sent[0] == ("user", "first question")
        and sent[1][0] == "assistant"
        and sent[2] == ("user", "second question")
    )
    msgs = await messages_of(mesh, trace_id)
    assert len(msgs) == 4 and {m.a2a_task_id for m in msgs} == {out["taskId"], out2["taskId"]}
