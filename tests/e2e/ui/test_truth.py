"""Cancel and failure keep the truth, in a real browser at a reader's pace (the scripted model writes
30 words a second): every tool card, subagent row and badge shows the state of its call (running,
completed, failed, cancelled) live and after a reload, a cancelled turn keeps what it streamed, every
callee and subagent can still be opened, and failures are said in sentences for people."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.async_api import Page, expect

from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh

PACE = 30  # words a second: a reader's pace, so that a test can act while a reply is written
LONG = " ".join(f"word{i}" for i in range(400))  # ~13 s at PACE: it never ends by itself in a test
RULES: dict[str, Any] = {
    "rules": [
        {
            # One step: a callee and two subagents at once, all slow.
            "system": r"\[general\]",
            "user": "^tree",
            "after_tool": False,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "callee task"}},
                {
                    "name": "delegate_parallel",
                    "arguments": {
                        "tasks": [{"goal": f"sub task {i}", "agentSlug": "coder"} for i in range(2)]
                    },
                },
            ],
        },
        {
            "system": r"\[general\]",
            "user": "^ask broken",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "broken", "input": "fail"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "All done."},
        {"system": r"\[general\]", "user": "^model breaks", "fault": "http_500"},
        {"system": r"\[broken\]", "fault": "http_500"},
        {"system": r"\[coder\]", "text": LONG, "tokens_per_second": PACE},
    ],
    "default": {"text": "ok"},
}
# What a person must never be shown: transport detail.
TRANSPORT = ("HTTP", "500", "grpc", "Traceback", "127.0.0.1", "StatusCode")


pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG)


async def stored_assistant(mesh: Mesh, session_id: str) -> dict[str, Any]:
    async with mesh.http() as http:
        messages = (await http.get(f"/api/sessions/{session_id}/messages")).json()["messages"]
    return next(m for m in reversed(messages) if m["role"] == "assistant")


async def test_cancel_settles_every_card_live_and_after_reload(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "tree please")
    invoke = reply.locator('.tool[data-tool="agent-invoke"]')
    delegate = reply.locator('.tool[data-tool="delegate_parallel"]')
    batch = reply.locator(".batch")
    panel_text = page.locator("#invoke-body .panel-text")

    # Live: the callee's text arrives while everything still runs.
    await expect(panel_text).to_contain_text("word5", timeout=T)
    await expect(batch.locator('.sub[data-status="running"]')).to_have_count(2, timeout=T)
    await expect(invoke.locator(".badge")).to_have_text("running")
    await expect(page.locator(".msg.streaming")).to_have_count(1)

    await page.click("#cancel")
    # Nothing stays blue: the cards, the batch and the panel say cancelled.
    await expect(reply.locator(".msg-error")).to_have_text("This reply was cancelled.", timeout=T)
    await expect(invoke.locator(".badge")).to_have_text("cancelled", timeout=T)
    await expect(delegate.locator(".badge")).to_have_text("cancelled")
    await expect(batch.locator(".batch-state")).to_have_text("cancelled", timeout=T)
    await expect(batch.locator(".batch-state")).to_have_attribute("data-status", "cancelled")
    await expect(batch.locator(".sub .badge")).to_have_text(["cancelled", "cancelled"])
    await expect(page.locator('.badge[data-status="running"]')).to_have_count(0)
    await expect(page.locator("#invoke-status")).to_have_text("cancelled", timeout=T)
    kept = await panel_text.inner_text()
    assert "word5" in kept, "the callee keeps the text it streamed"
    await expect(page.locator("#cancel")).to_be_hidden()

    # The callee opens again from its card (the panel was closed meanwhile).
    await page.click("#invoke-close")
    await invoke.locator(".open-trace").click()
    await expect(page.locator("#invoke-panel")).to_be_visible()
    await expect(panel_text).to_contain_text("word5")
    await expect(page.locator("#invoke-status")).to_have_text("cancelled")

    # After a reload: the same states, from the store.
    session_id = page.url.split("#/s/")[1]
    await page.reload()
    restored = page.locator(".msg.assistant").last
    await expect(restored.locator(".msg-error")).to_have_text("This reply was cancelled.", timeout=T)
    await expect(restored.locator(".batch .batch-state")).to_have_text("cancelled")
    await expect(restored.locator(".batch .sub .badge")).to_have_text(["cancelled", "cancelled"])
    await expect(page.locator('.badge[data-status="running"]')).to_have_count(0)
    # A cancelled subagent opens from the history with what it had written.
    await restored.locator(".sub .open-trace").first.click()
    await expect(page.locator("#invoke-status")).to_have_text("cancelled", timeout=T)
    await expect(page.locator("#invoke-body .panel-task")).to_contain_text("sub task 0")
    await expect(page.locator("#invoke-body .panel-text")).to_contain_text("word3", timeout=T)
    await page.keyboard.press("Escape")

    stored = await stored_assistant(mesh, session_id)
    assert stored["metadata"]["toolCalls"] and stored["metadata"]["error"]["code"] == "cancelled", stored
    await expect(restored.locator('.tool[data-tool="agent-invoke"] .badge')).to_have_text("cancelled")
    await expect(restored.locator('.tool[data-tool="delegate_parallel"] .badge')).to_have_text("cancelled")
    await restored.locator('.tool[data-tool="agent-invoke"] .open-trace').click()
    await expect(page.locator("#invoke-body .panel-text")).to_contain_text("word5", timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("cancelled")


async def test_failures_are_said_for_people(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    # A callee that fails: its card says failed, the panel says why in a sentence.
    reply = await send(page, "ask broken please")
    tool = reply.locator('.tool[data-tool="agent-invoke"]')
    await expect(tool.locator(".badge")).to_have_text("failed", timeout=T)
    await expect(tool).to_have_attribute("data-status", "failed")
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("failed", timeout=T)
    panel_error = await page.locator("#invoke-body .panel-error").inner_text()
    assert panel_error.endswith("."), panel_error
    assert not any(word in panel_error for word in TRANSPORT), panel_error

    # The model itself fails: the turn says so in a sentence, and so does the reloaded history.
    reply = await send(page, "model breaks now")
    error = reply.locator(".msg-error")
    await expect(error).to_be_visible(timeout=T)
    code = await error.get_attribute("data-code")
    text = await error.inner_text()
    assert code and code != "cancelled", code
    assert text.endswith(".") and not any(word in text for word in TRANSPORT), text
    await expect(reply.locator(".msg-retry")).to_be_visible()  # a failed turn can be tried again
    await page.reload()
    await expect(page.locator(".msg.assistant").last.locator(".msg-error")).to_have_text(text, timeout=T)
