"""Admission control: past AGENTMESH_MAX_TURNS chat (and A2A) turns on a replica, a new one is
refused at once — HTTP 429 with Retry-After and a JSON body, an `error` frame on the WebSocket — never
accepted and left to starve; the turns under a running turn (its callee, its subagents) are never
refused; once a turn ends, the next is taken."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import websockets
from prometheus_client import generate_latest

from tests.mesh import BACKENDS, TEST_CATALOG, TREE_RULE, Mesh, chat, sse_events

SLOW = {"text": "slow " * 60, "tokens_per_second": 30}
RULES: dict[str, Any] = {
    "rules": [
        TREE_RULE,
        {"system": r"\[general\]", "after_tool": True, "text": "all done"},
        {"system": r"\[general\]", "user": "^slow", **SLOW},
        {"system": r"\[coder\]", "text": "callee"},
        {"system": r"\[helper\]", "text": "subagent"},
    ],
    "default": {"text": "fine"},
}


pytestmark = pytest.mark.mesh(
    rules=RULES, catalog=TEST_CATALOG, backends=BACKENDS, scope="function", max_turns=2, retry_after_s=3
)


def refused_count(mesh: Mesh) -> float:
    registry = mesh.servers["orchestrator"].registry
    text = generate_latest(registry).decode()
    line = next(x for x in text.splitlines() if x.startswith("agentmesh_orchestrator_turns_refused_total"))
    return float(line.split()[-1])


async def test_past_the_limit_a_turn_is_refused_at_once_and_the_next_is_taken(mesh: Mesh) -> None:
    async with mesh.http(timeout=30) as http:
        running = [
            await http.send(
                http.build_request("POST", "/api/chat", json={"agent": "general", "message": f"slow {i}"}),
                stream=True,
            )
            for i in range(2)
        ]
        streams = [sse_events(resp) for resp in running]
        for resp, stream in zip(running, streams, strict=True):  # both streaming, text before their ends
            assert resp.status_code == 200
            async for event in stream:
                if event["type"] == "text-delta":
                    break
        before = refused_count(mesh)
        refused = await http.post("/api/chat", json={"agent": "general", "message": "one more"})
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["reason"] == "OVERLOADED"
        assert "try again" in refused.json()["error"]["message"]
        assert refused_count(mesh) == before + 1
        url = mesh.url.replace("http", "ws", 1) + f"/api/ws?apiKey={mesh.api_key}"
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "chat", "agent": "general", "message": "by socket"}))
            frame = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert (frame["type"], frame["status"], frame["code"]) == ("error", 429, "unavailable"), frame
        for resp, stream in zip(running, streams, strict=True):  # the running turns end well
            kinds = [e["type"] async for e in stream]
            assert kinds[-1] == "done", kinds
            await resp.aclose()
    assert (await chat(mesh, "general", "now there is room"))[-1]["type"] == "done"


async def test_the_turns_under_a_running_turn_are_never_refused(mesh: Mesh) -> None:
    """Two trees at the limit: each supervisor's callee and subagent still run (child turns do not
    count), and both trees end done."""
    results = await asyncio.gather(*(chat(mesh, "general", "tree") for _ in range(2)))
    for events in results:
        kinds = [e["type"] for e in events]
        assert kinds[-1] == "done" and "a2a-task-started" in kinds and "subagent-done" in kinds, kinds
        outputs = [e for e in events if e["type"] == "tool-output-available"]
        assert all(o["ok"] for o in outputs), outputs
