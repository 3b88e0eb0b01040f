"""The `make run` demo: the demo catalog and the bundled rules show agent-invoke and subagents at once."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.mesh import Mesh, chat, start_mesh


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    m = await start_mesh(tmp_path_factory.mktemp("demo"))  # the demo catalog + the bundled demo rules
    yield m
    await m.stop()


def text(events: list[dict]) -> str:
    return "".join(e["textDelta"] for e in events if e["type"] == "text-delta")


async def test_ask_the_coding_assistant(mesh: Mesh) -> None:
    events = await chat(mesh, "general", "Please ask the coding assistant to write fizzbuzz")
    call = next(e for e in events if e["type"] == "tool-input-available")
    assert call["toolName"] == "agent-invoke"
    assert call["input"] == {"agentSlug": "coder", "input": "to write fizzbuzz"}
    started = next(e for e in events if e["type"] == "a2a-task-started")
    assert started["calleeAgentName"] == "Coding Assistant"
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] and "to write fizzbuzz" in out["output"]["output"]
    assert text(events).startswith("The coding assistant replied:")
    assert events[-1]["type"] == "done"


async def test_split_this_into_subtasks(mesh: Mesh) -> None:
    events = await chat(mesh, "general", "split this into subtasks: a todo app", timeout=60)
    call = next(e for e in events if e["type"] == "tool-input-available")
    assert call["toolName"] == "delegate_parallel" and len(call["input"]["tasks"]) == 3
    done = next(e for e in events if e["type"] == "subagent-done")
    assert done["summary"] == {"total": 3, "completed": 3, "running": 0, "failed": 0, "cancelled": 0}
    final = text(events)
    assert "All three subtasks" in final
    # The subagents' replies come back into the final answer.
    items = [
        e["subagent"]
        for e in events
        if e["type"] == "subagent-update" and e["subagent"]["status"] == "completed"
    ]
    assert len(items) == 3
    for item in items:
        first_line = item["summary"].splitlines()[0]
        assert first_line and json.dumps(first_line)[1:-1] in final  # carried inside the JSON tool results


def test_demo_files_are_the_defaults() -> None:
    from agentmesh.libs.config import MeshSettings
    from agentmesh.mock_llm import DEMO_RULES

    assert MeshSettings().catalog.name == "demo_catalog.yaml" and MeshSettings().catalog.exists()
    assert Path(DEMO_RULES).exists()
