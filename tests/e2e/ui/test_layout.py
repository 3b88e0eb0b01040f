"""Any screen, any reader, in a real browser: the layout at 375x812 (the sidebar is a drawer, the message
box is usable, the side panel lies over the chat instead of squeezing it, nothing scrolls sideways),
dark mode from prefers-color-scheme, and accessibility: no serious axe-core violation in light or dark,
wide or narrow, an h1, a labelled message box, replies announced (role=log, aria-busy while streaming),
rename and delete reachable by keyboard on every chat, Escape closing the panel. The tests take the
README's screenshots at 1280 and 375 px wide, light and dark."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Browser, Page, ViewportSize, expect

from tests.e2e.ui.conftest import AXE
from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh, chat

PACE = 30
CODE = (
    "Here is the function:\n\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\n\nIt adds."
)
STORY = " ".join(f"word{i}" for i in range(150))  # 5 s at PACE
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^tour",
            "after_tool": False,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "write add()"}},
                {
                    "name": "delegate_parallel",
                    "arguments": {"tasks": [{"goal": f"part {i}", "agentSlug": "helper"} for i in range(2)]},
                },
            ],
        },
        {"system": r"\[general\]", "after_tool": True, "text": CODE},
        {"system": r"\[general\]", "user": "^slow", "text": STORY, "tokens_per_second": PACE},
        {"system": r"\[coder\]", "user": "slow", "text": STORY, "tokens_per_second": PACE},
        {"system": r"\[coder\]", "text": CODE},
        {"system": r"\[helper\]", "text": "Part done: **3 items** checked."},
    ],
    "default": {"text": "Answer to: {user}"},
}
WIDE: ViewportSize = {"width": 1280, "height": 800}
NARROW: ViewportSize = {"width": 375, "height": 812}


pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG)


async def open_page(browser: Browser, viewport: ViewportSize, scheme: str) -> Page:
    context = await browser.new_context(
        viewport=viewport,
        locale="en-US",
        timezone_id="UTC",
        color_scheme=scheme,  # type: ignore[arg-type]
    )
    page = await context.new_page()
    # The agent picker is in the drawer on a phone: the page starts with the general agent picked.
    await page.add_init_script("localStorage.setItem('agentmesh.agent', 'general')")
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.errors = errors  # type: ignore[attr-defined]
    return page


async def no_sideways_scroll(page: Page) -> None:
    width = await page.evaluate(
        "() => Math.max(document.documentElement.scrollWidth, document.body.scrollWidth)"
        " - document.documentElement.clientWidth"
    )
    assert width <= 0, f"the page scrolls sideways by {width}px"


async def serious_violations(page: Page) -> list[str]:
    """axe-core's WCAG 2.1 A/AA rules on the page as it is: the serious and critical violations."""
    if not await page.evaluate("typeof window.axe === 'object'"):
        await page.add_script_tag(path=str(AXE))
    result = await page.evaluate(
        """async () => (await axe.run(document, {
             runOnly: { type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa"] },
           })).violations.filter((v) => ["serious", "critical"].includes(v.impact))
             .map((v) => `${v.id}: ${v.nodes.slice(0, 3).map((n) => n.target.join(" ")).join(", ")}`)"""
    )
    return list(result)


async def tour(page: Page, mesh: Mesh) -> None:
    """A chat with a callee, a subagent batch and a code block, finished; the panel open."""
    await sign_in(page, mesh)
    await expect(page.locator("#app")).to_be_visible()
    reply = await send(page, "tour of the ui")
    await expect(reply.locator(".batch .batch-state")).to_have_text("done", timeout=T)
    await expect(reply.locator(".code-block")).to_be_visible(timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("done", timeout=T)


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_wide_screen_has_no_serious_accessibility_violation(
    browser: Browser, mesh: Mesh, shots: Path, scheme: str
) -> None:
    page = await open_page(browser, WIDE, scheme)
    await tour(page, mesh)
    background = await page.evaluate("getComputedStyle(document.documentElement).backgroundColor")
    assert (background == "rgb(255, 255, 255)") == (scheme == "light"), background
    await no_sideways_scroll(page)
    assert await serious_violations(page) == []
    await page.screenshot(path=str(shots / f"wide-{scheme}.png"), animations="disabled")
    await page.click("#invoke-close")
    assert await serious_violations(page) == []
    assert page.errors == []  # type: ignore[attr-defined]
    await page.context.close()


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_narrow_screen_works_in_one_column(
    browser: Browser, mesh: Mesh, shots: Path, scheme: str
) -> None:
    page = await open_page(browser, NARROW, scheme)
    await sign_in(page, mesh)
    await expect(page.locator("#app")).to_be_visible()
    # The sidebar is a drawer behind the menu button; the message box has the width.
    sidebar = page.locator("#sidebar")
    menu = page.get_by_role("button", name="Show chats")
    await expect(sidebar).to_be_hidden()
    await expect(menu).to_have_attribute("aria-expanded", "false")
    box = await page.locator("#input").bounding_box()
    assert box and box["width"] >= 200, box
    await no_sideways_scroll(page)

    await page.fill("#input", "tour on a phone")
    await page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").last
    await expect(reply.locator(".code-block")).to_be_visible(timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    # The panel lies over the chat: the chat keeps its width.
    panel = page.locator("#invoke-panel")
    await expect(panel).to_be_visible()
    chat_width = await page.locator("main.chat").evaluate("el => el.getBoundingClientRect().width")
    panel_box = await panel.bounding_box()
    assert chat_width >= 370, chat_width
    assert panel_box and panel_box["x"] <= 1 and panel_box["width"] >= 370, panel_box
    await no_sideways_scroll(page)
    assert await serious_violations(page) == []
    if scheme == "light":
        await page.screenshot(path=str(shots / "narrow-panel.png"), animations="disabled")
    await page.keyboard.press("Escape")  # Escape closes it
    await expect(panel).to_be_hidden()
    await no_sideways_scroll(page)
    assert await serious_violations(page) == []
    await page.screenshot(path=str(shots / f"narrow-{scheme}.png"), animations="disabled")

    await menu.click()
    await expect(sidebar).to_be_visible()
    await expect(menu).to_have_attribute("aria-expanded", "true")
    await expect(page.locator("#sessions .session.active")).to_be_visible()
    if scheme == "dark":
        await page.screenshot(path=str(shots / "narrow-sidebar.png"), animations="disabled")
    await page.keyboard.press("Escape")
    await expect(sidebar).to_be_hidden()
    await expect(menu).to_be_focused()
    await menu.click()
    await page.locator("#new-chat").click()  # choosing something closes the drawer
    await expect(sidebar).to_be_hidden()
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    assert page.errors == []  # type: ignore[attr-defined]
    await page.context.close()


async def test_the_page_reads_well_with_assistive_technology(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    await expect(page.get_by_role("heading", level=1)).to_have_text("New chat")
    await expect(page.get_by_role("textbox", name="Message")).to_be_visible()
    log = page.get_by_role("log", name="Conversation")
    await expect(log).to_have_attribute("aria-live", "polite")
    await expect(log).to_have_attribute("aria-busy", "false")
    reply = await send(page, "slow words for a screen reader")
    await expect(reply.locator(".content")).to_contain_text("word3", timeout=T)
    await expect(log).to_have_attribute("aria-busy", "true")  # announced once the reply is written
    await expect(log).to_have_attribute("aria-busy", "false", timeout=T)
    await expect(reply.locator(".content")).to_contain_text("word149")


async def test_every_chat_can_be_renamed_and_deleted_by_keyboard(page: Page, mesh: Mesh) -> None:
    one = str((await chat(mesh, "general", "keyboard one"))[0]["traceId"])
    await chat(mesh, "general", "keyboard two")
    await sign_in(page, mesh)
    item = page.locator(f'#sessions [data-session-id="{one}"]')  # not the open chat
    await expect(item).to_be_visible(timeout=T)
    await item.locator(".session-open").focus()
    await page.keyboard.press("Tab")
    rename = item.get_by_role("button", name="Rename keyboard one")
    await expect(rename).to_be_focused()
    assert await rename.evaluate("b => getComputedStyle(b).opacity") == "1"  # seen while focused
    await page.keyboard.press("Enter")
    edit = item.get_by_role("textbox", name="Chat title")
    await expect(edit).to_be_focused()
    await page.keyboard.press("Escape")
    await expect(rename).to_be_focused()  # back where the keyboard was
    await page.keyboard.press("Tab")
    delete = item.get_by_role("button", name="Delete keyboard one")
    await expect(delete).to_be_focused()
    await page.keyboard.press("Enter")
    dialog = page.get_by_role("dialog", name="Delete “keyboard one”?")
    await expect(dialog).to_be_visible()
    await expect(dialog.get_by_role("button", name="Delete")).to_be_focused()
    await page.keyboard.press("Escape")
    await expect(dialog).to_be_hidden()
    await expect(item).to_have_count(1)


async def test_escape_closes_the_panel(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    await send(page, "tour by keyboard")
    panel = page.locator("#invoke-panel")
    await expect(panel).to_be_visible(timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await page.locator("#input").focus()
    await page.keyboard.press("Escape")
    await expect(panel).to_be_hidden()
    await expect(page.get_by_role("button", name="Delegated runs (1)")).to_be_visible()
