"""The side panel and delegated runs in a real browser, at a user's pace: the panel opens only for a
call whose task exists, its text grows live before the tool ends, a dropped stream says so, and from
the history every agent-invoke call and every subagent opens its trace read-only (also after its live
buffer expired). The tests also take the README's screenshots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Error as PlaywrightError
from playwright.async_api import Locator, Page, Route, expect

from agentmesh.libs.config import StreamSettings
from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh, wait_until

STORY = "A story told slowly: " + " ".join(f"word{i}" for i in range(60))
CODE = "```python\ndef fizzbuzz(n):\n    return 'fizz' * (n % 3 == 0) + 'buzz' * (n % 5 == 0) or str(n)\n```"
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": r"invoke (?P<slug>[\w-]+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "{slug}", "input": "{rest}"}}],
        },
        {
            "system": r"\[general\]",
            "user": "^(?P<how>fan out|slow fan out)",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "delegate_parallel",
                    "arguments": {
                        "tasks": [{"goal": f"{{how}} part {i}", "agentSlug": "coder"} for i in range(2)]
                    },
                }
            ],
        },
        # The supervisor's answer after its subagents, at a reader's pace: the turn ends seconds
        # after its subagents did.
        {
            "system": r"\[general\]",
            "user": "end slowly",
            "after_tool": True,
            "text": STORY,
            "tokens_per_second": 20,
        },
        {"system": r"\[general\]", "after_tool": True, "text": "All done."},
        {"system": r"\[coder\]", "user": "slow", "text": STORY, "tokens_per_second": 20},
        {"system": r"\[coder\]", "text": "Here you are:\n\n" + CODE},
    ],
    "default": {"text": "ok"},
}


# Closed buffers expire after a second: a history older than that has only its stored traces.
pytestmark = pytest.mark.mesh(
    rules=RULES, catalog=TEST_CATALOG, stream=StreamSettings(ttl_s=1.0, heartbeat_s=5)
)


async def test_a_refused_call_never_opens_the_panel(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "invoke secret: hello")
    tool = reply.locator('.tool[data-tool="agent-invoke"]')
    await expect(tool.locator(".badge")).to_have_text("failed", timeout=T)
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)
    await tool.locator(".tool-toggle").click()
    await expect(tool.locator(".tool-output")).to_contain_text("may not call")
    await expect(page.locator("#invoke-panel")).to_be_hidden()
    await expect(tool.locator(".open-trace")).to_have_count(0)  # no trace to open


async def test_the_panel_text_grows_before_the_tool_card_is_done(page: Page, mesh: Mesh, shots: Path) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "invoke coder: slow story")
    panel_text = page.locator("#invoke-body .panel-text")
    await expect(panel_text).to_contain_text("word3", timeout=T)
    tool_badge = reply.locator('.tool[data-tool="agent-invoke"] .badge')
    assert await tool_badge.inner_text() == "running", "the text came while the tool still ran"
    assert await page.locator("#invoke-status").inner_text() == "streaming…"
    first = len(await panel_text.inner_text())
    await expect(panel_text).to_contain_text("word20", timeout=T)
    assert len(await panel_text.inner_text()) > first, "and it keeps growing"
    await page.screenshot(path=str(shots / "panel.png"))
    await expect(tool_badge).to_have_text("completed", timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("done", timeout=T)
    await expect(panel_text).to_contain_text("word59")


async def test_a_dropped_stream_says_the_connection_was_lost(page: Page, mesh: Mesh) -> None:
    async def drop(route: Route) -> None:
        await route.abort("connectionreset")

    await page.route("**/api/agents/a2a/stream*", drop)
    await sign_in(page, mesh)
    reply = await send(page, "invoke coder: anything")
    await expect(page.locator("#invoke-body .panel-error")).to_contain_text(
        "connection to this stream was lost", timeout=T
    )
    await expect(reply.locator('.tool[data-tool="agent-invoke"] .badge')).to_have_text("completed", timeout=T)
    # The tool's output still settles the call: its reply shows, marked done.
    await expect(page.locator("#invoke-status")).to_have_text("done", timeout=T)
    await expect(page.locator("#invoke-body .panel-text")).to_contain_text("def fizzbuzz")


async def screenshot(element: Locator, path: Path) -> None:
    """The element's picture, taken again when the view re-rendered it meanwhile (a turn's end reads
    its reply back from the history: the node it began with is gone)."""
    for attempt in range(3):
        try:
            await element.screenshot(path=str(path))
            return
        except PlaywrightError as err:
            if "not attached" not in err.message or attempt == 2:
                raise


async def test_the_history_reopens_every_delegated_run(page: Page, mesh: Mesh, shots: Path) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "invoke coder: fizzbuzz")
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)
    reply = await send(page, "fan out")
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)
    card = reply.locator(".batch")
    await expect(card.locator(".batch-summary")).to_have_text("2/2 completed · 0 failed", timeout=T)
    await screenshot(card, shots / "subagents.png")
    sub = card.locator(".sub").first
    sub_id = await sub.get_attribute("data-subagent-id")

    async def expired() -> bool:
        async with mesh.http() as http:
            r = await http.get(f"/api/subagents/{sub_id}/stream")
        return r.headers["content-type"].startswith("application/json") and r.json()["reason"] == "no-buffer"

    await wait_until(expired, 10, "the subagent's live buffer to expire")
    await page.reload()
    await expect(page.locator(".msg.assistant")).to_have_count(2, timeout=T)
    invoke = page.locator(".msg.assistant").first.locator('.tool[data-tool="agent-invoke"]')
    await invoke.locator(".open-trace").click()
    panel = page.locator("#invoke-panel")
    await expect(panel).to_be_visible()
    await expect(page.locator("#invoke-title")).to_have_text("coder")
    await expect(panel.locator(".panel-task")).to_contain_text("fizzbuzz")
    await expect(panel.locator(".panel-text pre > code")).to_contain_text("def fizzbuzz", timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("done")
    await expect(panel.locator("input, textarea, [contenteditable]")).to_have_count(0)  # read-only
    restored = page.locator(".msg.assistant").last.locator(".sub").first
    await restored.locator(".open-trace").click()
    await expect(page.locator("#invoke-title")).to_have_text("Coding Assistant")
    await expect(panel.locator(".panel-task")).to_contain_text("fan out part 0")
    await expect(panel.locator(".panel-text pre > code")).to_contain_text("def fizzbuzz", timeout=T)
    # The row's own live text comes from the stored trace once the buffer has expired.
    await restored.locator(".sub-head").click()
    await expect(restored.locator(".sub-live")).to_contain_text("def fizzbuzz", timeout=T)


async def test_a_cancelled_subagent_is_counted_as_cancelled(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "slow fan out")
    card = reply.locator(".batch")
    await expect(card.locator('.sub[data-status="running"]')).to_have_count(2, timeout=T)
    await expect(card.locator(".sub").first).to_be_visible()
    await page.click("#cancel")
    await expect(card.locator(".batch-summary")).to_have_text(
        "0/2 completed · 0 failed · 2 cancelled", timeout=T
    )
    await expect(card.locator('.sub[data-status="cancelled"]')).to_have_count(2)


async def test_a_subagent_opened_before_the_turn_ends_stays_open(page: Page, mesh: Mesh) -> None:
    """At a reader's pace: the subagents are done while the supervisor's answer still streams; the
    reader opens one's text then. When the turn ends, its stored batch updates the card where it is:
    the text the reader opened is the same element, still open (a card made anew would close it)."""
    await sign_in(page, mesh)
    reply = await send(page, "fan out, then end slowly")
    card = reply.locator(".batch")
    await expect(card.locator(".batch-summary")).to_have_text("2/2 completed · 0 failed", timeout=T)
    await expect(reply.locator(".content")).to_contain_text("word1", timeout=T)
    assert await reply.evaluate("el => el.classList.contains('streaming')"), "the turn ended too soon"
    await card.locator(".sub-head").first.click()
    live = card.locator(".sub-live").first
    await expect(live.locator("pre > code")).to_contain_text("def fizzbuzz", timeout=T)
    await live.evaluate("el => { el.dataset.openedBeforeEnd = 'yes'; }")
    await expect(reply.locator(".content")).to_contain_text("word59", timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await expect(card.locator('.sub-live[data-opened-before-end="yes"]')).to_be_visible()
    await expect(card.locator(".batch-summary")).to_have_text("2/2 completed · 0 failed")
