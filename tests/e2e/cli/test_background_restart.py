"""A background subagent whose runtime (or the orchestrator running it) is SIGKILLed and restarted while
it streams (each service its own process, `agentmesh serve`): its live reader ends `interrupted`, its row
ends failed with why (the orchestrator's engine settles it when the runtime died; the runtime and the
restarted orchestrator do when the orchestrator died), and its handle still answers the supervisor's
next turn, on the restarted service. On SQLite + memory and PostgreSQL + Redis
(docs/agents.md#background-subagents)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentmesh.events.v1 import events_pb2 as ev_pb
from agentmesh.libs import identity
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from tests.mesh import BACKENDS, ProcessMesh, SseReader, sse_events, wait_until

BOUND_S = 25.0
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^bg slow$",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "delegate_task",
                    "arguments": {"goal": "long job", "agentSlug": "coder", "background": True},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": "^status$",
            "after_tool": False,
            "tool_calls": [{"name": "subagent_status", "arguments": {}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "tool said: {tool_results}"},
        {"system": r"\[coder\]", "text": "slow " * 400, "tokens_per_second": 20},
    ]
}

pytestmark = pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES)


async def turn(mesh: ProcessMesh, message: str, session: str = "") -> list[dict[str, Any]]:
    body = {"agent": "general", "message": message, **({"sessionId": session} if session else {})}
    async with mesh.http(timeout=60) as http, http.stream("POST", "/api/chat", json=body) as resp:
        assert resp.status_code == 200
        async with asyncio.timeout(BOUND_S):
            return [event async for event in sse_events(resp)]


def tool_output(events: list[dict[str, Any]]) -> Any:
    return next(e for e in events if e["type"] == "tool-output-available")["output"]


@pytest.mark.parametrize("victim", ["agent-runtime", "orchestrator"])
async def test_a_restart_under_a_background_child_settles_it_and_its_handle_answers(
    process_mesh: ProcessMesh, victim: str
) -> None:
    mesh = process_mesh
    first = await turn(mesh, "bg slow")
    assert first[-1]["type"] == "done"
    session = first[0]["traceId"]
    (handle,) = tool_output(first)["handles"]
    reader = SseReader(lambda: mesh.http(timeout=60), f"/api/subagents/{handle['id']}/stream", reconnect=True)
    await asyncio.wait_for(reader.live.wait(), BOUND_S)  # it streams, its supervisor's turn long over

    await mesh.kill(victim)
    restart = asyncio.create_task(mesh.start(victim))
    await asyncio.wait_for(reader.task, BOUND_S)
    assert reader.end["type"] == "error" and reader.end["code"] == "interrupted", reader.events[-3:]
    await restart

    assert mesh.clients is not None

    async def row() -> Any:
        with identity.acting_as(mesh.user):
            request = sbs.GetSubagentSessionRequest(subagent_id=handle["id"])
            found = (await mesh.clients.subagents.GetSubagentSession(request)).subagent  # type: ignore[union-attr]
        return found if found.status == ev_pb.SUBAGENT_STATUS_FAILED else None

    settled = await wait_until(row, BOUND_S, "the child's row settled")
    assert settled.error.startswith("interrupted"), settled.error
    if victim == "agent-runtime":  # (a row the lease settles first, the orchestrator away, keeps no text)
        assert settled.summary.startswith("slow slow"), "what it streamed is kept"

    # Its handle answers the supervisor's next turn, run by the restarted runtime (once the
    # orchestrator's channel to it is back: a turn meanwhile ends `unavailable`, as test_faults.py's).
    async def status_turn() -> list[dict[str, Any]] | None:
        got = await turn(mesh, "status", session)
        return None if got[-1].get("code") == "unavailable" else got

    status = tool_output(await wait_until(status_turn, BOUND_S, "a turn on the restarted runtime"))
    assert [(c["id"], c["status"]) for c in status["subagents"]] == [(handle["id"], "failed")], status
    assert status["subagents"][0]["error"].startswith("interrupted")
