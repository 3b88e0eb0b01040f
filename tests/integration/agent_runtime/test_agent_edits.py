"""Agents edited while the mesh runs, on both backend pairs: an edit made through one gateway is used
by the next turn on every agent-runtime replica, with no restart (two runtime servers behind one
round-robin target, each with its own model server so the request log tells which replica ran a
turn); deleting an agent lets its running turn finish."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentmesh.gateway.app import create_app
from agentmesh.libs import embedded_http
from agentmesh.libs.config import LLMSettings
from agentmesh.libs.rpc import ServiceServer
from agentmesh.mock_llm import MockLLM
from agentmesh.services.agent_runtime import server as runtime_server
from tests.mesh import ANY_PORT, BACKENDS, Mesh, chat, sse_events, system_of, wait_until

SLOW = " ".join(f"w{i}" for i in range(30))
RULES: dict[str, Any] = {
    "rules": [{"user": "slow", "text": SLOW, "tokens_per_second": 20}],
    "default": {"text": "ok"},
}
V1, V2 = "You are version one.", "You are version two."


@dataclass
class Replicas:
    mesh: Mesh
    second: ServiceServer  # the second agent-runtime server
    mock2: MockLLM  # its model server (the first runtime's is mesh.mock)
    edit_url: str  # a second gateway, where the edits are made


# A mesh per test, whose orchestrator has called no runtime yet (see `replicas`), with a user of the
# test's own: the PostgreSQL database is shared by the run's meshes.
pytestmark = pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES, user="edits")


@pytest.fixture
async def replicas(mesh: Mesh) -> AsyncIterator[Replicas]:
    mock2 = MockLLM(RULES)
    await mock2.start()
    second: ServiceServer | None = None
    gateway2: embedded_http.EmbeddedServer | None = None
    try:
        own = mesh.settings.model_copy(deep=True)
        own.llm = LLMSettings(base_url=mock2.base_url, api_key="test", request_timeout_s=10)
        second = await runtime_server.build(own, ANY_PORT, mesh.signer)
        # The orchestrator has not called a runtime yet: its channel opens on this target at first use,
        # balanced round robin over both replicas (libs.rpc.channel).
        first = mesh.servers["agent-runtime"].target
        mesh.settings.addresses.agent_runtime = f"ipv4:{first},{second.target}"
        gateway2 = await embedded_http.serve(create_app(mesh.settings.model_copy(deep=True)))
        yield Replicas(mesh, second, mock2, f"http://127.0.0.1:{gateway2.port}")
    finally:
        if gateway2 is not None:
            await gateway2.stop()
        if second is not None:
            await second.stop(1.0)
        await mock2.stop()


def prompts(mock: MockLLM, start: int = 0) -> list[str]:
    return [system_of(body) for body in mock.requests()[start:]]


async def test_an_edit_is_used_by_the_next_turn_on_every_replica(replicas: Replicas) -> None:
    mesh, mock1, mock2 = replicas.mesh, replicas.mesh.mock, replicas.mock2
    async with httpx.AsyncClient(
        base_url=replicas.edit_url, headers={"Authorization": f"Bearer {mesh.api_key}"}, timeout=30
    ) as editor:
        created = await editor.post(
            "/api/agents", json={"slug": "editable", "name": "Editable", "systemPrompt": V1}
        )
        assert created.status_code == 201, created.text

        sessions: list[str] = []

        async def turns_until_both_ran(prompt: str, starts: tuple[int, int]) -> int:
            """Turns (new sessions) until both replicas' model servers saw `prompt`; how many it took."""
            for n in range(1, 11):
                events = await chat(mesh, "editable", f"turn {n}")
                assert events[-1]["type"] == "done", events[-1]
                sessions.append(events[0]["traceId"])
                seen = [prompts(mock1, starts[0]), prompts(mock2, starts[1])]
                if all(prompt in p for p in seen):
                    return n
            raise AssertionError(f"both replicas did not run a turn: {seen}")

        before = await turns_until_both_ran(V1, (0, 0))
        marks = (len(mock1.requests()), len(mock2.requests()))
        # The edit, made through the other gateway; no process restarts or is told.
        patched = await editor.patch(
            "/api/agents/editable", json={"systemPrompt": V2}, headers={"If-Match": created.headers["etag"]}
        )
        assert patched.status_code == 200 and patched.headers["etag"] == '"2"', patched.text
        after = await turns_until_both_ran(V2, marks)
    # Every turn after the edit, the very first included, on either replica, used the new prompt. A
    # new session's run starts with the agent as its orchestrator last read it (V1) while the agent is
    # read again: the read shows the edit, and that run is dropped before it stored anything (the
    # replies' versions below), at most once per orchestrator replica.
    since = prompts(mock1, marks[0]) + prompts(mock2, marks[1])
    assert since.count(V2) == after and set(since) <= {V1, V2}, since
    assert since.count(V1) <= 2, since
    # Each reply records the version of the agent that produced it.
    async with mesh.http() as http:
        versions = [
            (await http.get(f"/api/sessions/{sid}/messages")).json()["messages"][-1]["metadata"][
                "agentVersion"
            ]
            for sid in sessions
        ]
    assert versions == [1] * before + [2] * after
    assert before + after <= 6, "round robin spreads consecutive turns over both replicas"


async def test_deleting_an_agent_lets_its_running_turn_finish(replicas: Replicas) -> None:
    mesh = replicas.mesh
    async with mesh.http() as http:
        assert (await http.post("/api/agents", json={"slug": "doomed", "name": "Doomed"})).status_code == 201
        async with http.stream("POST", "/api/chat", json={"agent": "doomed", "message": "slow"}) as resp:
            assert resp.status_code == 200
            events: list[dict[str, Any]] = []
            deleted = False
            async with asyncio.timeout(30):
                async for event in sse_events(resp):
                    events.append(event)
                    if event["type"] == "text-delta" and not deleted:
                        # Mid-reply: the agent goes away, the turn that already read it goes on.
                        assert (await http.delete("/api/agents/doomed")).status_code == 200
                        deleted = True
        assert deleted and events[-1]["type"] == "done", events[-1]
        assert "".join(e["textDelta"] for e in events if e["type"] == "text-delta") == SLOW
        session = next(e for e in events if e["type"] == "start")["traceId"]
        saved = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
        assert [(m["role"], m["status"]) for m in saved] == [
            ("user", "completed"),
            ("assistant", "completed"),
        ]
        assert saved[-1]["content"] == SLOW
        # The next turn with it is refused, like any unknown agent.
        again = await http.post(
            "/api/chat", json={"agent": "doomed", "message": "hello", "sessionId": session}
        )
        assert again.status_code == 404 and again.json()["error"]["message"] == "unknown agent 'doomed'"
    await wait_until(lambda: mesh.mock.stats()["in_flight"] == 0 and replicas.mock2.stats()["in_flight"] == 0)
