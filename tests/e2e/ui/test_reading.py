"""Reading replies in a real browser at a reader's pace: code is highlighted and copied with one click,
images load only from the mesh's own origin (unless the reader allows other sites) and once, however
often a streaming reply renders, each callee has its own tab (agent and task) with its task on top of
the live panel and opens again while it runs, subagent results read whole without scrolling boxes, and
the sidebar finds a chat by its title or its content."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from playwright.async_api import Page, Route, expect

from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh, chat

PACE = 30
CODE = 'def greet(name: str) -> str:\n    # say hello\n    return f"hello {name}"\n'
FENCED = f"Here:\n\n```python\n{CODE}```\n\nThat is all."
ELSEWHERE = "http://192.0.2.7"  # TEST-NET-1: never reached (the test's route answers for it)
PICTURE = (
    "A picture: ![our logo](/ui/test-logo.png) and one from elsewhere: "
    f"![their logo]({ELSEWHERE}/logo.png)\n\nThen the reply goes on: "
    + " ".join(f"more{i}" for i in range(45))
)
LONG_CODE = "```python\n" + "\n".join(f"line_{i} = {i}  # a long result line" for i in range(60)) + "\n```"
STORY = " ".join(f"story{i}" for i in range(240))  # 8 s at PACE
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^two callees",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "agent-invoke",
                    "arguments": {"agentSlug": "coder", "input": ["write the parser", "write the tests"]},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": "^long results",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "delegate_parallel",
                    "arguments": {"tasks": [{"goal": "long code", "agentSlug": "coder"}]},
                }
            ],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "All done."},
        {"system": r"\[general\]", "user": "^show code", "text": FENCED, "tokens_per_second": PACE},
        {"system": r"\[general\]", "user": "^picture", "text": PICTURE, "tokens_per_second": PACE},
        {"system": r"\[coder\]", "user": "long code", "text": LONG_CODE},
        {"system": r"\[coder\]", "text": STORY, "tokens_per_second": PACE},
    ],
    "default": {"text": "Answer to: {user}"},
}
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg=="
)


pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG)


async def test_code_is_highlighted_and_copied(page: Page, mesh: Mesh) -> None:
    await page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=mesh.url)
    await sign_in(page, mesh)
    reply = await send(page, "show code")
    block = reply.locator(".code-block")
    await expect(block.locator("pre > code")).to_have_text(CODE, timeout=T)
    await expect(block.locator(".code-lang")).to_have_text("python")
    await expect(block.locator("code .hljs-keyword").first).to_have_text("def")
    await expect(block.locator("code .hljs-comment")).to_have_text("# say hello")
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    copy = block.get_by_role("button", name="Copy python to the clipboard")
    await copy.click()
    await expect(copy).to_have_text("Copied")
    assert await page.evaluate("navigator.clipboard.readText()") == CODE
    await page.reload()  # restored the same way
    await expect(page.locator(".code-block code .hljs-keyword").first).to_have_text("def", timeout=T)


async def test_images_load_from_our_origin_once_and_others_only_when_allowed(page: Page, mesh: Mesh) -> None:
    ours: list[str] = []
    theirs: list[str] = []

    async def logo(route: Route) -> None:
        ours.append(route.request.url)
        # no-store: every new <img> for it would ask again, so a count of one means one element
        await route.fulfill(
            status=200, body=PNG, content_type="image/png", headers={"Cache-Control": "no-store"}
        )

    async def elsewhere(route: Route) -> None:
        theirs.append(route.request.url)
        await route.fulfill(status=200, body=PNG, content_type="image/png")

    await page.route(f"{mesh.url}/ui/test-logo.png", logo)
    await page.route(f"{ELSEWHERE}/**", elsewhere)
    await sign_in(page, mesh)
    await expect(page.locator("#app")).to_be_visible()
    reply = await send(page, "picture please")
    image = reply.locator('img[alt="our logo"]')
    await expect(image).to_be_visible(timeout=T)
    await image.evaluate("img => { img.dataset.first = 'yes'; }")  # the element as first shown
    await expect(reply.locator(".content")).to_contain_text("more5")
    await expect(page.locator(".msg.streaming")).to_have_count(1)  # still streaming after the image
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await expect(reply.locator(".content")).to_contain_text("more44")
    assert len(ours) == 1, ours
    await expect(image).to_have_attribute("data-first", "yes")  # the same element, never rendered again
    assert await image.evaluate("img => img.complete && img.naturalWidth") == 1
    # The other site's image is not loaded: its place says so and links to it.
    blocked = reply.locator(".img-blocked")
    await expect(blocked).to_have_text("Image “their logo” from 192.0.2.7 not loaded")
    await expect(blocked.locator("a")).to_have_attribute("href", f"{ELSEWHERE}/logo.png")
    await expect(reply.locator(f'img[src^="{ELSEWHERE}"]')).to_have_count(0)
    assert theirs == []

    # Allowed in the settings: the chat renders again with it.
    await page.locator(".settings summary").click()
    await page.get_by_label("Show images from other sites in replies").check()
    await expect(page.locator(f'.msg.assistant img[src="{ELSEWHERE}/logo.png"]')).to_be_visible(timeout=T)
    assert theirs == [f"{ELSEWHERE}/logo.png"]
    await page.get_by_label("Show images from other sites in replies").uncheck()
    await expect(page.locator(".msg.assistant .img-blocked")).to_have_count(1, timeout=T)


async def test_each_callee_has_its_tab_its_task_and_opens_again(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "two callees")
    tabs = page.locator("#invoke-tabs .tab")
    await expect(tabs).to_have_count(2, timeout=T)
    for task in ("write the parser", "write the tests"):
        await expect(tabs.filter(has_text=f"Coding Assistant · {task}")).to_have_count(1, timeout=T)
    # The shown run's task is on top of the panel while its reply streams.
    body = page.locator("#invoke-body")
    await expect(body.locator(".panel-text")).to_contain_text("story3", timeout=T)
    await expect(page.locator("#invoke-status")).to_have_text("streaming…")
    shown = await page.locator("#invoke-tabs .tab.active").inner_text()
    task = shown.split(" · ")[1]
    await expect(body.locator(".panel-task")).to_contain_text(task)
    await tabs.filter(has_text="write the parser").click()
    await expect(body.locator(".panel-task")).to_contain_text("write the parser")

    # Closed while the callees run, it opens again from the card (or the header) and has kept up.
    await page.keyboard.press("Escape")
    await expect(page.locator("#invoke-panel")).to_be_hidden()
    await expect(page.locator("#show-panel")).to_have_text("Delegated runs (2)")
    tool = reply.locator('.tool[data-tool="agent-invoke"]')
    await expect(tool.locator(".badge")).to_have_text("running")
    await tool.get_by_role("button", name="Open Coding Assistant's reply 2 in the side panel").click()
    await expect(page.locator("#invoke-panel")).to_be_visible()
    await expect(page.locator("#invoke-title")).to_be_focused()
    await expect(page.locator("#invoke-tabs .tab.active")).to_have_count(1)
    text = await body.locator(".panel-text").inner_text()
    await expect(body.locator(".panel-text")).not_to_have_text(text, timeout=T)  # it still grows
    assert await tool.locator(".badge").inner_text() == "running"
    await page.click("#cancel")
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)


async def test_subagent_results_read_whole_without_inner_scrolling(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "long results")
    row = reply.locator(".sub").first
    await expect(row.locator(".badge")).to_have_text("completed", timeout=T)
    result = row.locator(".sub-result")
    await expect(result.locator("pre code")).to_contain_text("line_59 = 59")
    more = row.get_by_role("button", name="Show all")
    await expect(more).to_be_visible()
    await more.click()
    await expect(row.get_by_role("button", name="Show less")).to_have_attribute("aria-expanded", "true")
    # No box inside the card scrolls vertically: the whole code is on the page.
    boxes = await reply.evaluate(
        """m => [...m.querySelectorAll(".batch *")].filter((el) => {
             const s = getComputedStyle(el);
             return ["auto", "scroll"].includes(s.overflowY) && el.scrollHeight > el.clientHeight + 1;
           }).map((el) => el.className)"""
    )
    assert boxes == [], boxes
    last = result.locator("pre code")
    assert await last.evaluate("c => c.getBoundingClientRect().height") > 60 * 12  # all 60 lines


async def test_the_sidebar_finds_chats_by_title_and_content(page: Page, mesh: Mesh) -> None:
    titled = str((await chat(mesh, "general", "alpha plan for the week"))[0]["traceId"])
    other = str((await chat(mesh, "general", "beta notes"))[0]["traceId"])
    async with mesh.http() as http:  # a word only its content has
        await http.patch(f"/api/sessions/{other}", json={"title": "Notes"})
    await chat(mesh, "general", "the zebra crossing", session_id=other)
    await sign_in(page, mesh)
    search = page.get_by_role("searchbox", name="Search chats by title and content")
    items = page.locator("#sessions .session")
    await search.fill("alpha")
    await expect(items).to_have_count(1, timeout=T)
    await expect(items.first).to_have_attribute("data-session-id", titled)
    await search.fill("zebra")
    await expect(items).to_have_count(1, timeout=T)
    await expect(items.first).to_have_attribute("data-session-id", other)
    await expect(items.first.locator(".session-snippet")).to_contain_text("zebra crossing")
    await expect(page.locator("#search-status")).to_have_text("1 chat found")
    await search.fill("nothing like this")
    await expect(page.locator("#search-status")).to_have_text("No chat matches your search", timeout=T)
    await search.press("Escape")
    await expect(search).to_have_value("")
    assert await items.count() >= 2
