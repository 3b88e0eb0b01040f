"""Background subagents (docs/agents.md#background-subagents), with the children's model slowed: the
delegate call returns at once with handles; subagent_status, subagent_wait and subagent_stop answer from
the rows and buffers; a finished child is noted once in the parent's next turn; the limits (how many
at once, their own timeout); the parent's cancel leaves them running, a delete stops them. On both
backend pairs; the restart of the runtime under a running child: test_background_restart.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentmesh.events.v1 import events_pb2 as ev_pb
from agentmesh.libs import identity
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.ids import subagent_key
from agentmesh.services.agent_runtime.background import NOTE_HEAD
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from tests.mesh import (
    BACKENDS,
    TEST_CATALOG,
    Mesh,
    SseReader,
    chat,
    read_buffer,
    sse_events,
    system_of,
    wait_until,
)

WORDS = 80  # at 20 tokens a second: four seconds of a child's text
# A foreground subagent's deadline (3 s) is shorter than a slow child; a background one's (8 s) is not.
DEFAULTS = SubagentDefaults(max_concurrent=3, timeout_ms=3000, max_background=2, background_timeout_ms=8000)


def delegate(user: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The supervisor answers `user` (a regex, its named groups usable in the arguments) with a call."""
    return {
        "system": r"\[general\]",
        "user": user,
        "after_tool": False,
        "tool_calls": [{"name": tool, "arguments": arguments}],
    }


def bg(goal: str, slug: str = "coder") -> dict[str, Any]:
    return {"goal": goal, "agentSlug": slug, "background": True}


def fg(goal: str) -> dict[str, Any]:
    return {"goal": goal, "agentSlug": "coder"}


RULES: dict[str, Any] = {
    "rules": [
        delegate("^bg slow$", "delegate_task", bg("slow job")),
        delegate("^bg quick$", "delegate_task", bg("quick job", "helper")),
        delegate("^bg forever$", "delegate_task", bg("forever job")),
        delegate(
            "^bg two$", "delegate_parallel", {"tasks": [bg("forever a"), bg("forever b")], "background": True}
        ),
        delegate(
            "^fg three$",
            "delegate_parallel",
            {"tasks": [fg("forever q1"), fg("forever q2"), fg("forever q3")]},
        ),
        delegate("^status$", "subagent_status", {}),
        delegate("^status (?P<sid>\\S+)$", "subagent_status", {"id": "{sid}"}),
        delegate("^wait$", "subagent_wait", {"timeoutMs": 20000}),
        delegate("^stop all$", "subagent_stop", {}),
        delegate("^stop (?P<sid>\\S+)$", "subagent_stop", {"id": "{sid}"}),
        delegate("^bg slow and talk$", "delegate_task", bg("slow job")),
        {
            "system": r"\[general\]",
            "user": "^bg slow and talk$",
            "after_tool": True,
            "text": "talk " * 200,
            "tokens_per_second": 20,
        },
        {"system": r"\[general\]", "after_tool": True, "text": "tool said: {tool_results}"},
        {"system": r"\[coder\]", "user": "^forever", "text": "more " * 2000, "tokens_per_second": 20},
        {"system": r"\[coder\]", "text": "slow " * WORDS, "tokens_per_second": 20},
        {"system": r"\[helper\]", "text": "helped with {user}"},
    ],
    "default": {"text": "plain answer"},
}

pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=TEST_CATALOG, subagent=DEFAULTS)


def tool_output(events: list[dict[str, Any]]) -> Any:
    return next(e for e in events if e["type"] == "tool-output-available")["output"]


async def row_of(mesh: Mesh, sub_id: str) -> Any:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        request = sbs.GetSubagentSessionRequest(subagent_id=sub_id)
        return (await mesh.clients.subagents.GetSubagentSession(request)).subagent


async def status_is(mesh: Mesh, sub_id: str, status: int) -> bool:
    return bool((await row_of(mesh, sub_id)).status == status)


def request_of(mesh: Mesh, user: str, start: int = 0) -> dict[str, Any]:
    """The supervisor's first model request of the turn whose input was `user`."""
    for body in mesh.mock.requests()[start:]:
        users = [m["content"] for m in body["messages"] if m["role"] == "user"]
        if "[general]" in system_of(body) and users and users[-1] == user:
            return body
    raise AssertionError(f"no request for {user!r}")


def notes(body: dict[str, Any]) -> list[str]:
    return [m["content"] for m in body["messages"] if m["role"] == "system" and NOTE_HEAD in m["content"]]


async def test_a_background_child_returns_at_once_and_its_handle_answers(mesh: Mesh) -> None:
    first = await chat(mesh, "general", "bg slow")
    out = tool_output(first)
    assert out["ok"] is True and out["background"] is True, out
    (handle,) = out["handles"]
    sub_id, trace = handle["id"], first[0]["traceId"]
    assert handle["traceId"] and handle["goal"] == "slow job"
    assert first[-1]["type"] == "done"
    # The supervisor's turn ended while its child had four seconds of text ahead of it.
    row = await row_of(mesh, sub_id)
    assert row.background and row.status in (ev_pb.SUBAGENT_STATUS_QUEUED, ev_pb.SUBAGENT_STATUS_RUNNING)
    assert row.child_trace_id == handle["traceId"]
    # Its text streams live; the runs page lists it while it runs.
    reader = SseReader(lambda: mesh.http(timeout=30), f"/api/subagents/{sub_id}/stream")
    await asyncio.wait_for(reader.live.wait(), 10)
    async with mesh.http() as http:
        runs = (await http.get("/api/runs", params={"kind": "subagent", "state": "running"})).json()["runs"]
    assert sub_id in [r.get("subagentId") for r in runs]
    # subagent_status: running, with what it wrote so far.
    status = tool_output(await chat(mesh, "general", f"status {sub_id}", session_id=trace))
    (child,) = status["subagents"]
    assert child["status"] == "running" and child["latest"].startswith("slow slow"), child
    # subagent_wait: until it ends, then its result.
    waited = tool_output(await chat(mesh, "general", "wait", session_id=trace))
    assert waited["ended"] is True
    assert [(c["id"], c["status"], c["summary"]) for c in waited["subagents"]] == [
        (sub_id, "completed", "slow " * WORDS)
    ]
    await asyncio.wait_for(reader.task, 10)
    assert reader.end["type"] == "done"
    text_at = [e["_t"] for e in reader.events if e["type"] == "text-delta"]
    assert text_at and text_at[0] < reader.events[-1]["_t"] - 0.5, "its text arrived while it ran"
    # It outlived the foreground timeout (3 s): a background child has its own (8 s).
    assert (await row_of(mesh, sub_id)).status == ev_pb.SUBAGENT_STATUS_COMPLETED
    # The wait told the supervisor how it ended: no note says it again.
    start = len(mesh.mock.requests())
    await chat(mesh, "general", "hello after wait", session_id=trace)
    assert notes(request_of(mesh, "hello after wait", start)) == []


async def test_a_finished_child_is_noted_once_in_the_next_turn(mesh: Mesh) -> None:
    first = await chat(mesh, "general", "bg quick")
    (handle,) = tool_output(first)["handles"]
    trace = first[0]["traceId"]
    await wait_until(lambda: status_is(mesh, handle["id"], ev_pb.SUBAGENT_STATUS_COMPLETED), 10, "the child")
    start = len(mesh.mock.requests())
    await chat(mesh, "general", "hello two", session_id=trace)
    (note,) = notes(request_of(mesh, "hello two", start))
    assert handle["id"] in note and "completed: helped with quick job" in note, note
    await chat(mesh, "general", "hello three", session_id=trace)
    # The next turn has it once: in its history, where the earlier turn was told, never again as new.
    body = request_of(mesh, "hello three", start)
    assert notes(body) == [note]
    users = [i for i, m in enumerate(body["messages"]) if m["content"] == "hello two"]
    assert body["messages"][users[0] + 1]["content"] == note


async def test_stop_one_and_the_parents_cancel_does_not_stop_them(mesh: Mesh) -> None:
    # The supervisor's turn is cancelled while it talks: its background child goes on.
    async with (
        mesh.http(timeout=30) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "bg slow and talk"}) as resp,
    ):
        got: list[dict[str, Any]] = []
        stream = sse_events(resp)
        async with asyncio.timeout(20):
            async for event in stream:
                got.append(event)
                if event["type"] == "text-delta":
                    break
            trace = got[0]["traceId"]
            assert (await http.post(f"/api/sessions/{trace}/cancel")).json() == {"cancelled": True}
            async for event in stream:
                got.append(event)
    assert got[-1]["type"] == "error" and got[-1]["code"] == "cancelled"
    (handle,) = tool_output(got)["handles"]
    await wait_until(lambda: status_is(mesh, handle["id"], ev_pb.SUBAGENT_STATUS_COMPLETED), 15, "it ends")

    # The runs page's stop of a background child (it outlives its supervisor's turn): its own route.
    (other,) = tool_output(await chat(mesh, "general", "bg forever", session_id=trace))["handles"]
    await wait_until(lambda: status_is(mesh, other["id"], ev_pb.SUBAGENT_STATUS_RUNNING), 10, "it runs")
    async with mesh.http() as http:
        runs = (await http.get("/api/runs", params={"kind": "subagent", "state": "running"})).json()["runs"]
        assert [r["background"] for r in runs if r["subagentId"] == other["id"]] == [True]
        stranger = await mesh.new_user(f"stranger-{other['id']}")
        async with mesh.http(api_key=stranger) as theirs:
            assert (await theirs.post(f"/api/subagents/{other['id']}/cancel")).status_code == 404
        assert (await http.post(f"/api/subagents/{other['id']}/cancel")).json() == {"cancelled": True}
    await wait_until(lambda: status_is(mesh, other["id"], ev_pb.SUBAGENT_STATUS_CANCELLED), 10, "stopped")

    # subagent_stop: the one named ends cancelled, its buffer too.
    (forever,) = tool_output(await chat(mesh, "general", "bg forever", session_id=trace))["handles"]
    await wait_until(lambda: status_is(mesh, forever["id"], ev_pb.SUBAGENT_STATUS_RUNNING), 10, "it runs")
    stopped = tool_output(await chat(mesh, "general", f"stop {forever['id']}", session_id=trace))
    assert stopped["stopped"] == [forever["id"]]
    assert [c["status"] for c in stopped["subagents"]] == ["cancelled"], stopped
    last = (await read_buffer(mesh, subagent_key(forever["id"])))[-1]
    assert last.error.code == ev_pb.ERROR_CODE_CANCELLED
    # A handle that is not one of this chat's children answers not_found.
    missing = tool_output(await chat(mesh, "general", "status sub-nobody", session_id=trace))
    assert missing["ok"] is False and missing["code"] == "not_found"


async def test_limits_stop_all_and_a_delete_stops_them(mesh: Mesh) -> None:
    first = await chat(mesh, "general", "bg two")
    trace = first[0]["traceId"]
    ids = [h["id"] for h in tool_output(first)["handles"]]
    assert len(ids) == 2
    # At most two open at once per supervisor and trace: a third is refused, and nothing is created.
    refused = tool_output(await chat(mesh, "general", "bg quick", session_id=trace))
    assert refused["ok"] is False and refused["code"] == "resource_exhausted", refused
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        request = sbs.ListSubagentSessionsRequest(trace_id=trace)
        assert len((await mesh.clients.subagents.ListSubagentSessions(request)).subagents) == 2
    # subagent_stop with no id stops every one still running.
    stopped = tool_output(await chat(mesh, "general", "stop all", session_id=trace))
    assert sorted(stopped["stopped"]) == sorted(ids)
    assert [c["status"] for c in stopped["subagents"]] == ["cancelled", "cancelled"], stopped
    # Their own timeout (8 s, not the foreground 3 s) ends one left running.
    (left,) = tool_output(await chat(mesh, "general", "bg forever", session_id=trace))["handles"]
    await wait_until(lambda: status_is(mesh, left["id"], ev_pb.SUBAGENT_STATUS_RUNNING), 10, "it runs")
    await wait_until(lambda: status_is(mesh, left["id"], ev_pb.SUBAGENT_STATUS_FAILED), 15, "its timeout")
    row = await row_of(mesh, left["id"])
    assert row.error.startswith("timeout") and "8000 ms" in row.error, row.error
    # The trace's deletion stops one that runs: its reader gets the end, its model call stops.
    (doomed,) = tool_output(await chat(mesh, "general", "bg forever", session_id=trace))["handles"]
    reader = SseReader(lambda: mesh.http(timeout=30), f"/api/subagents/{doomed['id']}/stream")
    await asyncio.wait_for(reader.live.wait(), 10)
    async with mesh.http() as http:
        assert (await http.delete(f"/api/sessions/{trace}")).status_code == 200
    await asyncio.wait_for(reader.task, 10)
    assert reader.end["type"] == "error" and reader.end["code"] == "cancelled", reader.end
    await mesh.mock.wait_idle(timeout=10)  # nothing runs the children's model any more


async def test_a_subagent_stopped_while_queued_never_runs(mesh: Mesh) -> None:
    """Three in a batch that runs two at once (general's maxConcurrent): the third, stopped while it
    waits, ends cancelled at once and never reaches the model; the other two go on."""
    start = len(mesh.mock.requests())
    async with (
        mesh.http(timeout=30) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "fg three"}) as resp,
    ):
        rows: dict[str, str] = {}
        stream = sse_events(resp)
        async with asyncio.timeout(20):
            async for event in stream:
                if event["type"] == "subagent-update":
                    rows[event["subagent"]["goal"]] = event["subagent"]["id"]
                    if len(rows) == 3:
                        break
            queued = rows["forever q3"]
            assert (await row_of(mesh, queued)).status == ev_pb.SUBAGENT_STATUS_QUEUED
            assert (await http.post(f"/api/subagents/{queued}/cancel")).json() == {"cancelled": True}
            await wait_until(lambda: status_is(mesh, queued, ev_pb.SUBAGENT_STATUS_CANCELLED), 5, "it ends")
            for goal in ("forever q1", "forever q2"):
                assert (await row_of(mesh, rows[goal])).status == ev_pb.SUBAGENT_STATUS_RUNNING, goal
            got = [event async for event in stream]  # the others end at their (foreground) timeout
    out = tool_output(got)
    assert [(r["goal"], r["status"]) for r in out["results"]] == [
        ("forever q1", "failed"),
        ("forever q2", "failed"),
        ("forever q3", "cancelled"),
    ], out
    users = [m["content"] for b in mesh.mock.requests()[start:] for m in b["messages"] if m["role"] == "user"]
    assert "forever q1" in users and "forever q3" not in users, "the stopped one never ran"
