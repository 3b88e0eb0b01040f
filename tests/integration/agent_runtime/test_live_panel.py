"""The side panel (docs/requirements.md#invoke-side-panel) at a user's pace: a reader that subscribes to the
callee's stream the instant it
sees `a2a-task-started` always finds the buffer and receives the callee's text live, before the
caller's tool call ends. 50 runs on each backend pair, the callee's model slowed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.mesh import BACKENDS, TEST_CATALOG, Mesh, sse_events

RUNS = 50
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^panel",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "{user}"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "ok"},
        # 12 pieces at 200 tokens a second: the callee streams for about 60 ms.
        {"system": r"\[coder\]", "text": "one two three four five six seven eight nine ten eleven twelve",
         "tokens_per_second": 200},
    ],
}  # fmt: skip


pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=TEST_CATALOG)


async def one_run(mesh: Mesh, n: int) -> tuple[float, float, str]:
    """(when the panel's first callee delta arrived, when the caller's tool output arrived, its text)."""
    async with mesh.http() as http:
        first_delta = asyncio.get_running_loop().create_future()
        text: list[str] = []

        async def panel(task_id: str) -> None:
            async with http.stream("GET", f"/api/agents/a2a/stream?taskId={task_id}") as resp:
                assert resp.status_code == 200, await resp.aread()  # never {"reason": "no-buffer"}
                assert resp.headers["content-type"].startswith("text/event-stream")
                async for event in sse_events(resp):
                    if event["type"] == "text-delta":
                        text.append(event["textDelta"])
                        if not first_delta.done():
                            first_delta.set_result(time.monotonic())

        follower = None
        async with http.stream(
            "POST", "/api/chat", json={"agent": "general", "message": f"panel {n}"}
        ) as resp:
            async for event in sse_events(resp):
                if event["type"] == "a2a-task-started":
                    follower = asyncio.create_task(panel(event["taskId"]))  # the instant it is seen
                if event["type"] == "tool-output-available":
                    tool_done = time.monotonic()
        assert follower is not None
        await asyncio.wait_for(follower, 10)
        return await first_delta, tool_done, "".join(text)


async def test_the_panel_streams_live_every_time(mesh: Mesh) -> None:
    early = 0
    for n in range(RUNS):
        first_delta, tool_done, text = await one_run(mesh, n)
        assert text == "one two three four five six seven eight nine ten eleven twelve"
        early += first_delta < tool_done
    assert early == RUNS, f"the panel saw live text before the tool ended in {early} of {RUNS} runs"
