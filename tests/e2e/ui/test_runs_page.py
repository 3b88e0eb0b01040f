"""The runs page in a real browser against a whole mesh at a slowed model pace, on both backend pairs: a
chat turn and the agent-invoke callee it starts appear running (the sidebar's badge counts them), then
end done without a reload (the page refreshes itself while anything runs); a run opens its trace (a
chat turn its chat, a callee the side panel); Stop on a subagent stops the turn that started it and
everything under it; a background subagent's card and run end after its turn; the page keeps the UI's
accessibility and fits a phone."""

from __future__ import annotations

import re

import pytest
import yaml
from playwright.async_api import Browser, Page, expect

from agentmesh.mock_llm import DEMO_RULES
from tests.e2e.ui.test_layout import NARROW, no_sideways_scroll, open_page, serious_violations
from tests.e2e.ui.test_ui import send, sign_in
from tests.mesh import BACKENDS, Mesh

T = 15_000  # ms: the longest any page condition may take
SLOW_T = 40_000  # ms: a whole turn at the slowed pace

# The demo agents and rules, at 20 tokens a second: a turn runs for seconds.
pytestmark = pytest.mark.mesh(backends=BACKENDS, user="runs-ui", tokens_per_second=20)


def run_row(page: Page, kind: str, state: str | None = None):  # type: ignore[no-untyped-def]
    selector = f'.run[data-kind="{kind}"]' + (f'[data-state="{state}"]' if state else "")
    return page.locator(selector).first


async def test_a_running_run_appears_then_ends_done(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh, mesh.api_key)
    badge = page.locator("#runs-badge")
    await expect(badge).to_be_hidden()
    reply = await send(page, "ask the coding assistant to write fizzbuzz")
    await expect(page.locator("#invoke-panel")).to_be_visible(timeout=T)  # the callee began
    await expect(badge).to_be_visible(timeout=T)
    assert int(await badge.text_content() or "0") >= 1
    await expect(page.locator("#open-runs")).to_contain_text("running")  # what a screen reader reads

    await page.click("#open-runs")
    await expect(page.locator("#runs-page")).to_be_visible()
    await expect(page.locator("main.chat")).to_be_hidden()
    assert page.url.endswith("#/runs")
    chat, callee = run_row(page, "chat"), run_row(page, "callee")
    await expect(chat).to_have_attribute("data-state", "running", timeout=T)
    await expect(callee).to_have_attribute("data-state", "running", timeout=T)
    await expect(callee.locator(".run-agent")).to_contain_text("coder · agent-invoke")
    await expect(callee.locator(".run-meta")).to_contain_text("from ")
    await expect(chat.locator(".run-stop")).to_be_visible()
    await expect(page.locator("#runs-status")).to_contain_text("running")

    # No reload: the page follows both to their end, and the badge goes.
    await expect(callee).to_have_attribute("data-state", "done", timeout=SLOW_T)
    await expect(chat).to_have_attribute("data-state", "done", timeout=SLOW_T)
    await expect(chat.locator(".run-stop")).to_have_count(0)
    await expect(chat.locator(".run-meta")).to_contain_text("tokens")
    await expect(badge).to_be_hidden(timeout=T)

    # A callee opens its trace in the side panel; a chat turn opens its chat.
    await callee.locator(".run-open").click()
    await expect(page.locator("#invoke-panel")).to_be_visible(timeout=T)
    await expect(page.locator("#invoke-body")).to_contain_text("FizzBuzz", timeout=T)
    await chat.locator(".run-open").click()
    await expect(page.locator("main.chat")).to_be_visible(timeout=T)
    await expect(page.locator("#runs-page")).to_be_hidden()
    await expect(reply.locator(".content").first).to_contain_text("coding assistant replied", timeout=T)
    await page.go_back()  # the runs page is a history entry like a chat
    await expect(page.locator("#runs-page")).to_be_visible(timeout=T)


async def test_stop_on_a_subagent_stops_its_whole_turn(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh, mesh.api_key)
    await send(page, "split this into subtasks: a todo app")
    await expect(page.locator("#runs-badge")).to_be_visible(timeout=T)
    await page.click("#open-runs")
    sub = run_row(page, "subagent", "running")
    await expect(sub).to_be_visible(timeout=T)
    chat_turn = run_row(page, "chat")
    await expect(chat_turn).to_have_attribute("data-state", "running")
    await sub.locator(".run-stop").click()
    await expect(chat_turn).to_have_attribute("data-state", "cancelled", timeout=T)
    await expect(page.locator('.run[data-state="running"]')).to_have_count(0, timeout=T)
    await expect(page.locator('.run[data-kind="subagent"][data-state="cancelled"]').first).to_be_visible()
    await expect(page.locator("#runs-badge")).to_be_hidden(timeout=T)
    await page.select_option("#runs-state", "cancelled")
    await expect(page.locator(".run").first).to_have_attribute("data-state", "cancelled", timeout=T)
    await expect(page.locator('.run:not([data-state="cancelled"])')).to_have_count(0)


async def test_a_background_subagent_ends_on_its_card_after_its_turn(page: Page, mesh: Mesh) -> None:
    """Its turn's events stop at its handle (queued): the card follows the subagent's own buffer to its
    end, without a reload, and so does its run. (13 s of text: past the 10 s a chat's cards are read
    again from their rows after a turn, which covers a short child.)"""
    demo = yaml.safe_load(DEMO_RULES.read_text())
    slow = {"system": "Research Assistant", "user": "vector", "text": "slowly " * 260}  # at 20/s
    mesh.mock.set_rules({**demo, "rules": [slow, *demo["rules"]]})
    try:
        await sign_in(page, mesh, mesh.api_key)
        reply = await send(page, "research in the background: vector databases")
        item = reply.locator(".batch .sub")
        await expect(reply.locator(".content").first).to_contain_text(
            "runs in the background", timeout=SLOW_T
        )
        await expect(item).to_have_attribute("data-status", re.compile("queued|running"))  # the turn ended
        await expect(item).to_have_attribute("data-status", "completed", timeout=SLOW_T)
        await expect(item.locator(".sub-result")).to_contain_text("slowly slowly")
        await expect(reply.locator(".batch")).to_have_attribute("data-status", "completed")
        await page.click("#open-runs")
        await expect(run_row(page, "subagent", "done")).to_be_visible(timeout=T)
    finally:
        mesh.mock.set_rules(DEMO_RULES.read_text())


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_the_page_is_accessible_and_fits_a_phone(browser: Browser, mesh: Mesh, scheme: str) -> None:
    page = await open_page(browser, NARROW, scheme)
    await sign_in(page, mesh, mesh.api_key)
    await page.goto(f"{mesh.url}/#/runs")
    await expect(page.locator("#runs-page")).to_be_visible(timeout=T)
    await expect(page.locator(".run").first).to_be_visible(timeout=T)  # the earlier tests' runs
    await no_sideways_scroll(page)
    assert await serious_violations(page) == []
    # Keyboard: the filter and each run's link are reachable and labelled.
    await expect(page.get_by_role("combobox", name="Show", exact=True)).to_be_visible()
    await page.get_by_role("button", name="Show chats").click()
    await expect(page.locator("#open-runs")).to_be_visible()
    await page.locator("#open-runs").focus()
    await page.keyboard.press("Enter")
    await expect(page.locator("#runs-page")).to_be_visible()
    assert page.errors == []  # type: ignore[attr-defined]
    await page.context.close()
