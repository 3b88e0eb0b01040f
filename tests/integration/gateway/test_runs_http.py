"""GET /api/runs on a real mesh at a slowed model pace, on both backend pairs: a chat turn and the
agent-invoke callee it starts are listed running while they stream, then done with their end times and
tokens; subagents are listed with their supervisor's turn as parent; a running turn stopped through the
cancel route ends cancelled; an A2A task served to a client is listed, and stopped with CancelTask;
filters and bad input; another user's runs never appear."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.mesh import BACKENDS, Mesh, chat, sse_events, wait_until

pytestmark = pytest.mark.mesh(backends=BACKENDS, user="runs", tokens_per_second=40)


async def runs(mesh: Mesh, api_key: str | None = None, **params: Any) -> list[dict[str, Any]]:
    async with mesh.http(api_key) as http:
        resp = await http.get("/api/runs", params=params)
    assert resp.status_code == 200, resp.text
    return list(resp.json()["runs"])


def by_message(listed: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["messageId"]: r for r in listed}


async def test_a_turn_and_its_callee_are_listed_running_then_done(mesh: Mesh) -> None:
    body = {"agent": "general", "message": "ask the coding assistant to write fizzbuzz"}
    seen: dict[str, Any] = {}
    async with mesh.http() as http, http.stream("POST", "/api/chat", json=body) as resp:
        assert resp.status_code == 200
        async for event in sse_events(resp):
            if event["type"] == "start":
                seen["start"] = event
            elif event["type"] == "a2a-task-started":
                seen["task"] = event["taskId"]
                # The callee streams at the slowed pace: both runs are running now.
                running = await runs(mesh, state="running")
                assert {r["kind"] for r in running} >= {"chat", "callee"}
                turn = by_message(running)[seen["start"]["assistantMessageId"]]
                assert (turn["kind"], turn["traceId"], turn["agent"]) == (
                    "chat",
                    seen["start"]["traceId"],
                    "general",
                )
                assert "endTime" not in turn and turn["startTime"]
                (callee,) = [r for r in running if r["kind"] == "callee"]
                assert (callee["taskId"], callee["agent"], callee["parentTraceId"]) == (
                    event["taskId"],
                    "coder",
                    seen["start"]["traceId"],
                )
                assert callee["parentMessageId"] == seen["start"]["assistantMessageId"]
                assert callee["callerAgent"] == "general"
                seen["callee"] = callee["messageId"]
    trace = seen["start"]["traceId"]
    done = by_message(await runs(mesh, state="done"))
    for message_id in (seen["start"]["assistantMessageId"], seen["callee"]):
        run = done[message_id]
        assert run["state"] == "done" and run["endTime"] >= run["startTime"]
        assert run["usage"]["outputTokens"] > 0
    assert not [r for r in await runs(mesh, state="running") if trace in (r["traceId"], r["parentTraceId"])]


async def test_subagents_name_their_supervisors_turn(mesh: Mesh) -> None:
    events = await chat(mesh, "general", "split this into subtasks: a todo app")
    start = next(e for e in events if e["type"] == "start")
    subs = [r for r in await runs(mesh, kind="subagent") if r["parentTraceId"] == start["traceId"]]
    assert len(subs) == 3
    assert {r["parentMessageId"] for r in subs} == {start["assistantMessageId"]}
    assert all(r["state"] == "done" and r["subagentId"] and r["title"] for r in subs)
    assert {r["subagentId"] for r in subs} == {
        e["subagent"]["id"] for e in events if e["type"] == "subagent-update"
    }


async def test_a_running_turn_stopped_from_the_list_ends_cancelled(mesh: Mesh) -> None:
    body = {"agent": "general", "message": "hello " + "and more " * 40}
    start: dict[str, Any] = {}
    async with mesh.http() as http, http.stream("POST", "/api/chat", json=body) as resp:
        assert resp.status_code == 200
        async for event in sse_events(resp):
            start = start or event
            if event["type"] == "text-delta":
                break
        running = by_message(await runs(mesh, state="running", kind="chat"))
        run = running[start["assistantMessageId"]]
        assert run["traceId"] == start["traceId"]
        async with mesh.http() as other:
            stopped = await other.post(f"/api/sessions/{run['traceId']}/cancel")
        assert stopped.status_code == 200 and stopped.json() == {"cancelled": True}
    cancelled = await wait_until(
        lambda: _has(mesh, run["messageId"], "cancelled"), what="the run listed cancelled"
    )
    assert cancelled["endTime"]


async def _has(mesh: Mesh, message_id: int, state: str) -> dict[str, Any] | None:
    return by_message(await runs(mesh, state=state)).get(message_id)


async def test_another_users_runs_never_appear(mesh: Mesh) -> None:
    await chat(mesh, "general", "hello")
    mine = await runs(mesh)
    assert mine
    other = await mesh.new_user(f"other-{mesh.user}")
    assert await runs(mesh, other) == []
    await chat(mesh, "general", "hello", api_key=other)
    theirs = await runs(mesh, other)
    assert len(theirs) == 1 and theirs[0]["traceId"] not in {r["traceId"] for r in mine}
    assert theirs[0]["messageId"] not in by_message(await runs(mesh))


async def test_pages_and_filters(mesh: Mesh) -> None:
    everything = await runs(mesh, page_size=200)
    assert len(everything) >= 3
    seen: list[int] = []
    token = ""
    async with mesh.http() as http:
        while True:
            page = (await http.get("/api/runs", params={"page_size": 2, "page_token": token})).json()
            seen += [r["messageId"] for r in page["runs"]]
            token = page["nextPageToken"]
            if not token:
                break
    assert seen == [r["messageId"] for r in everything]
    assert {r["agent"] for r in await runs(mesh, agent="coder")} == {"coder"}
    assert await runs(mesh, agent="no-such-agent") == []


@pytest.mark.parametrize(
    "params",
    [
        {"state": "bogus"},
        {"kind": "everything"},
        {"agent": "Not A Slug"},
        {"page_size": 201},
        {"page_token": "bm90LWEtdG9rZW4"},
    ],
)
async def test_bad_input_is_a_422(mesh: Mesh, params: dict[str, Any]) -> None:
    async with mesh.http() as http:
        resp = await http.get("/api/runs", params=params)
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert (error["code"], error["reason"]) == (422, "INVALID_ARGUMENT") and error["message"]


async def test_no_key_no_runs(mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        resp = await http.get("/api/runs")
    assert resp.status_code == 401


async def a2a_call(mesh: Mesh, method: str, params: dict[str, Any]) -> dict[str, Any]:
    async with mesh.http() as http:
        resp = await http.post(
            "/a2a/coder", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
        )
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert "result" in body, body
    return dict(body["result"])


async def test_an_a2a_task_served_to_a_client_is_listed_and_stopped_with_cancel_task(mesh: Mesh) -> None:
    message = {
        "role": "user",
        "parts": [{"kind": "text", "text": "write fizzbuzz"}],
        "messageId": "m1",
        "kind": "message",
    }
    task = await a2a_call(mesh, "message/send", {"message": message, "configuration": {"blocking": False}})
    running = await wait_until(
        lambda: _task_run(mesh, task["id"], "running"), what="the A2A task listed running"
    )
    assert (running["kind"], running["agent"], running["parentTraceId"]) == ("a2a", "coder", "")
    await a2a_call(mesh, "tasks/cancel", {"id": task["id"]})  # what the runs page's Stop sends
    cancelled = await wait_until(
        lambda: _task_run(mesh, task["id"], "cancelled"), what="the A2A task listed cancelled"
    )
    assert cancelled["messageId"] == running["messageId"] and cancelled["endTime"]


async def _task_run(mesh: Mesh, task_id: str, state: str) -> dict[str, Any] | None:
    return next((r for r in await runs(mesh, kind="a2a", state=state) if r["taskId"] == task_id), None)
