"""A running turn with an agent-invoke callee and subagents, at a user's pace (the model slowed):
deleting its session ends every stream of the tree and leaves nothing readable; cancelling keeps what
every run had already streamed. On SQLite + memory and PostgreSQL + Redis."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from tests.mesh import BACKENDS, TEST_CATALOG, Mesh, SseReader, sse_events, wait_live, wait_until

SLOW = 20  # tokens per second: a reply of 200 words takes 10 s
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^tree",
            "after_tool": False,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "slow callee"}},
                {
                    "name": "delegate_parallel",
                    "arguments": {"tasks": [{"goal": "slow sub", "agentSlug": "helper"}]},
                },
            ],
        },
        {
            "system": r"\[general\]",
            "user": "^talk",
            "text": "I am thinking about it " + "slowly " * 200,
            "tokens_per_second": SLOW,
        },
        {
            "system": r"\[general\]",
            "user": "^invoke",
            "text": "Asking the coder first. ",
            "tokens_per_second": SLOW,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "slow callee"}}
            ],
            "after_tool": False,
        },
        {"system": r"\[coder\]", "text": "callee words " * 200, "tokens_per_second": SLOW},
        {"system": r"\[helper\]", "text": "subagent words " * 200, "tokens_per_second": SLOW},
    ],
    "default": {"text": "done"},
}


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=TEST_CATALOG)


async def test_deleting_a_running_session_ends_every_stream_and_leaves_nothing_readable(mesh: Mesh) -> None:
    async with (
        mesh.http(timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "tree"}) as resp,
    ):
        turn = sse_events(resp)
        got: list[dict[str, Any]] = []
        task_id = subagent_id = ""
        async with asyncio.timeout(20):
            async for event in turn:
                got.append(event)
                if event["type"] == "a2a-task-started":
                    task_id = event["taskId"]
                if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                    subagent_id = event["subagent"]["id"]
                if task_id and subagent_id:
                    break
        session = got[0]["traceId"]
        paths = [
            f"/api/sessions/{session}/stream",
            f"/api/agents/a2a/stream?taskId={task_id}",
            f"/api/subagents/{subagent_id}/stream",
        ]
        readers = [SseReader(lambda: mesh.http(timeout=60), p) for p in paths]
        # Every reader follows live text before the delete (the model streams at 20 tokens a second).
        await wait_live(readers[1:], 20)
        deleted = await http.delete(f"/api/sessions/{session}")
        assert (deleted.status_code, deleted.json()) == (200, {"deleted": True})
        async with asyncio.timeout(10):
            async for event in turn:
                got.append(event)
            await asyncio.gather(*(r.task for r in readers))
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled", got[-1]
    for reader, path in zip(readers, paths, strict=True):
        assert reader.status == 200, path
        assert reader.last == "error" and reader.events[-1]["code"] == "cancelled", (path, reader.events[-3:])
    # Nothing of the tree is readable any more: not the session, not its streams.
    async with mesh.http() as http:
        for path in [*paths, f"/api/sessions/{session}", f"/api/sessions/{session}/messages"]:
            r = await http.get(path)
            assert r.status_code == 404 and r.json()["error"]["reason"] == "NOT_FOUND", path
    await mesh.mock.wait_idle(timeout=10)  # no run of the tree keeps calling the model


async def test_cancel_keeps_what_was_streamed(mesh: Mesh) -> None:
    """The user sees text, cancels: the assistant message keeps that text, marked cancelled."""
    async with (
        mesh.http(timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "talk"}) as resp,
    ):
        stream = sse_events(resp)
        got: list[dict[str, Any]] = []
        async with asyncio.timeout(20):
            async for event in stream:
                got.append(event)
                if sum(e["type"] == "text-delta" for e in got) == 5:
                    break
            assert (await http.post(f"/api/sessions/{got[0]['traceId']}/cancel")).json() == {
                "cancelled": True
            }
            async for event in stream:
                got.append(event)
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled"
    seen = "".join(e["textDelta"] for e in got if e["type"] == "text-delta")
    assert seen.startswith("I am thinking")
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{got[0]['traceId']}/messages")).json()["messages"]
    assistant = messages[-1]
    assert assistant["status"] == "cancelled" and assistant["metadata"]["error"]["code"] == "cancelled"
    assert assistant["content"].startswith(seen), "what the user saw stays"
    assert len(assistant["content"]) < len("I am thinking about it " + "slowly " * 200)


async def test_cancel_keeps_the_callees_text_and_the_callers_tool_call(mesh: Mesh) -> None:
    async with (
        mesh.http(timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "invoke"}) as resp,
    ):
        stream = sse_events(resp)
        got: list[dict[str, Any]] = []
        async with asyncio.timeout(20):
            async for event in stream:
                got.append(event)
                if event["type"] == "a2a-task-started":
                    break
            path = f"/api/agents/a2a/stream?taskId={got[-1]['taskId']}"
            callee = SseReader(lambda: mesh.http(timeout=60), path)
            await wait_live([callee], 10)
            await wait_until(
                lambda: sum(e["type"] == "text-delta" for e in callee.events) >= 5, 10, "callee text"
            )
            assert (await http.post(f"/api/sessions/{got[0]['traceId']}/cancel")).json() == {
                "cancelled": True
            }
            async for event in stream:
                got.append(event)
            await callee.task
    assert got[-1]["code"] == "cancelled" and callee.events[-1]["code"] == "cancelled"
    caller_text = "".join(e["textDelta"] for e in got if e["type"] == "text-delta")
    callee_text = "".join(e["textDelta"] for e in callee.events if e["type"] == "text-delta")
    async with mesh.http() as http:
        caller = (await http.get(f"/api/sessions/{got[0]['traceId']}/messages")).json()["messages"][-1]
        trace = next(e for e in got if e["type"] == "a2a-task-started")["traceId"]
        callee_msg = (await http.get(f"/api/sessions/{trace}/messages")).json()["messages"][-1]
    assert caller["status"] == "cancelled" and caller["content"] == caller_text == "Asking the coder first. "
    calls = caller["metadata"]["toolCalls"]
    assert [c["name"] for c in calls] == ["agent-invoke"] and calls[0]["input"]["agentSlug"] == "coder"
    assert callee_msg["status"] == "cancelled" and callee_msg["content"].startswith(callee_text)
    assert callee_text.startswith("callee words")


async def test_deleting_every_session_stops_their_turns(mesh: Mesh) -> None:
    async with (
        mesh.http(timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "talk"}) as resp,
    ):
        stream = sse_events(resp)
        got = [await anext(stream)]
        with contextlib.suppress(StopAsyncIteration):
            got.append(await anext(stream))
        wiped = await http.delete("/api/sessions")
        assert wiped.status_code == 200 and wiped.json()["deletedCount"] >= 1
        async with asyncio.timeout(10):
            async for event in stream:
                got.append(event)
        assert (await http.get("/api/sessions")).json()["sessions"] == []
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled"
    await mesh.mock.wait_idle(timeout=10)
