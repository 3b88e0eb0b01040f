"""The `make run` demo: the demo catalog and the bundled rules show agent-invoke and subagents at once,
and the general assistant's answers read as prose that uses the tools' results (never their JSON)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from agentmesh.mock_llm.rules import brief
from tests.mesh import Mesh, sse_events

SLOW = 40.0  # tokens per second: the final answer streams for about two seconds


@pytest.fixture(scope="module", params=[0.0, SLOW], ids=["fast", "slowed"])
def mesh_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The demo catalog and the bundled demo rules, at full speed or with the model slowed."""
    return {"tokens_per_second": request.param}


async def turn(mesh: Mesh, message: str) -> list[dict[str, Any]]:
    """One turn of the general assistant over POST /api/chat; each event carries `_t` (when it came)."""
    out: list[dict[str, Any]] = []
    async with (
        mesh.http(timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": message}) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        async for event in sse_events(resp):
            event["_t"] = time.monotonic()
            out.append(event)
    assert out[-1]["type"] == "done", out[-3:]
    return out


def final_text(events: list[dict[str, Any]]) -> str:
    """The text of the answer's last step (after its tool results)."""
    last_tool = max(i for i, e in enumerate(events) if e["type"] == "tool-output-available")
    return "".join(e["textDelta"] for e in events[last_tool:] if e["type"] == "text-delta")


def assert_streamed_before_the_end(mesh: Mesh, events: list[dict[str, Any]]) -> None:
    """With the model slowed, the answer's text arrives while the turn still runs, not at its end."""
    if not mesh.mock.tokens_per_second:
        return
    first = next(e["_t"] for e in events if e["type"] == "text-delta")
    assert events[-1]["_t"] - first > 0.5, "the text came in one piece at the end of the turn"


async def test_ask_the_coding_assistant(mesh: Mesh) -> None:
    events = await turn(mesh, "Please ask the coding assistant to write fizzbuzz")
    call = next(e for e in events if e["type"] == "tool-input-available")
    assert call["toolName"] == "agent-invoke"
    assert call["input"] == {"agentSlug": "coder", "input": "to write fizzbuzz"}
    started = next(e for e in events if e["type"] == "a2a-task-started")
    assert started["calleeAgentName"] == "Coding Assistant"
    out = next(e for e in events if e["type"] == "tool-output-available")
    callee = out["output"]["output"]
    assert out["ok"] and "def fizzbuzz" in callee
    final = final_text(events)
    # The callee's markdown as it wrote it: real newlines, the code fence intact; no ids, no JSON.
    assert final.startswith("The coding assistant replied:\n\n")
    assert callee.strip() in final
    assert "```python\ndef fizzbuzz(n: int) -> str:\n" in final and final.count("```") == 2
    assert '{"' not in final and "\\n" not in final
    for value in (started["taskId"], started["traceId"], out["output"]["taskId"]):
        assert value not in final
    assert_streamed_before_the_end(mesh, events)


async def test_split_this_into_subtasks(mesh: Mesh) -> None:
    events = await turn(mesh, "split this into subtasks: a todo app")
    call = next(e for e in events if e["type"] == "tool-input-available")
    assert call["toolName"] == "delegate_parallel" and len(call["input"]["tasks"]) == 3
    done = next(e for e in events if e["type"] == "subagent-done")
    assert done["summary"] == {"total": 3, "completed": 3, "running": 0, "failed": 0, "cancelled": 0}
    items = {
        e["subagent"]["id"]: e["subagent"]
        for e in events
        if e["type"] == "subagent-update" and e["subagent"]["status"] == "completed"
    }
    assert len(items) == 3
    final = final_text(events)
    assert final.startswith('The three subtasks for "a todo app" are done:\n\n')
    # The subagents' summaries as a short markdown list, one line each; no ids, no JSON.
    lines = [line for line in final.splitlines() if line.startswith("- ")]
    assert sorted(lines) == sorted(f"- **{i['name']}**: {brief(i['summary'])}" for i in items.values())
    assert {item["name"] for item in items.values()} == {
        "Research Assistant",
        "General Assistant (clone)",
        "Coding Assistant",
    }
    assert "```" not in final and '{"' not in final
    for sub_id in items:
        assert sub_id not in final
    assert_streamed_before_the_end(mesh, events)


def test_demo_files_are_the_defaults() -> None:
    from agentmesh.libs.config import MeshSettings
    from agentmesh.mock_llm import DEMO_RULES

    assert MeshSettings().catalog.name == "demo_catalog.yaml" and MeshSettings().catalog.exists()
    assert Path(DEMO_RULES).exists()
