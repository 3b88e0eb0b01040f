"""Moving around the web UI as a person does, in a real browser: Back and Forward move between chats, a
deleted chat's link says the chat no longer exists, the header has the chat's title as soon as the
sidebar does (during the first turn, not after it), and a delete asks first and stops a running turn
before the chat goes."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.async_api import Page, expect

from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh, chat

PACE = 30
LONG = " ".join(f"word{i}" for i in range(300))  # 10 s at PACE
RULES: dict[str, Any] = {
    "rules": [{"system": r"\[general\]", "user": "^slow", "text": LONG, "tokens_per_second": PACE}],
    "default": {"text": "Answer to: {user}"},
}


pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG)


async def new_session(mesh: Mesh, text: str) -> str:
    events = await chat(mesh, "general", text)
    return str(events[0]["traceId"])


async def test_back_and_forward_move_between_chats(page: Page, mesh: Mesh) -> None:
    first = await new_session(mesh, "first chat")
    second = await new_session(mesh, "second chat")
    await sign_in(page, mesh)
    await page.locator(f'#sessions [data-session-id="{first}"] .session-open').click()
    await expect(page.locator(".msg.assistant .content")).to_have_text("Answer to: first chat", timeout=T)
    await page.locator(f'#sessions [data-session-id="{second}"] .session-open').click()
    await expect(page.locator(".msg.assistant .content")).to_have_text("Answer to: second chat", timeout=T)
    await expect(page.locator("#chat-title")).to_have_text("second chat")

    await page.go_back()
    assert page.url.endswith(f"#/s/{first}")
    await expect(page.locator(".msg.assistant .content")).to_have_text("Answer to: first chat", timeout=T)
    await expect(page.locator("#chat-title")).to_have_text("first chat")
    await expect(page.locator(f'#sessions [data-session-id="{first}"]')).to_have_class("session active")
    await page.go_back()  # the new chat the page opened on
    await expect(page.locator("#chat-title")).to_have_text("New chat", timeout=T)
    await expect(page.locator(".msg")).to_have_count(0)
    await page.go_forward()
    await page.go_forward()
    assert page.url.endswith(f"#/s/{second}")
    await expect(page.locator(".msg.assistant .content")).to_have_text("Answer to: second chat", timeout=T)


async def test_a_deleted_chats_link_says_it_no_longer_exists(page: Page, mesh: Mesh) -> None:
    gone = await new_session(mesh, "soon gone")
    async with mesh.http() as http:
        assert (await http.delete(f"/api/sessions/{gone}")).status_code == 200
    await sign_in(page, mesh)
    await page.goto(f"{mesh.url}/#/s/{gone}")
    await expect(page.locator(".not-found")).to_contain_text("This chat no longer exists.", timeout=T)
    await expect(page.locator("#chat-title")).to_have_text("Chat not found")
    await expect(page.locator("#sessions .session.active")).to_have_count(0)
    await page.get_by_role("button", name="Start a new chat").click()
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    await expect(page.locator("#input")).to_be_focused()


async def test_the_header_has_the_title_during_the_first_turn(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    reply = await send(page, "slow start of a chat")
    await expect(reply.locator(".content")).to_contain_text("word3", timeout=T)
    session_id = page.url.split("#/s/")[1]
    item = page.locator(f'#sessions [data-session-id="{session_id}"] .session-title')
    await expect(item).to_have_text("slow start of a chat", timeout=T)
    await expect(page.locator("#chat-title")).to_have_text("slow start of a chat")
    await expect(page.locator(".msg.streaming")).to_have_count(1)  # and the turn still runs
    await page.click("#cancel")
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)


async def test_delete_asks_first_and_stops_the_running_turn(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "slow one to delete")
    await expect(reply.locator(".content")).to_contain_text("word3", timeout=T)
    session_id = page.url.split("#/s/")[1]
    item = page.locator(f'#sessions [data-session-id="{session_id}"]')
    dialog = page.locator("#confirm")

    # Asked, and declined: nothing happens, the turn goes on.
    await item.locator(".session-delete").click()
    await expect(dialog).to_be_visible()
    await expect(dialog).to_contain_text("slow one to delete")
    await expect(dialog).to_contain_text("still being written")
    await page.keyboard.press("Escape")
    await expect(dialog).to_be_hidden()
    await expect(item).to_have_count(1)
    length = len(await reply.locator(".content").inner_text())
    await expect(reply.locator(".content")).not_to_have_text(await reply.locator(".content").inner_text())
    assert len(await reply.locator(".content").inner_text()) > length, "the turn goes on"

    # Confirmed: the turn is cancelled first, then the chat deleted.
    calls: list[str] = []
    page.on(
        "request",
        lambda r: calls.append(f"{r.method} {r.url.split(mesh.url)[1]}") if session_id in r.url else None,
    )
    await item.locator(".session-delete").click()
    await dialog.get_by_role("button", name="Delete").click()
    await expect(item).to_have_count(0, timeout=T)
    await expect(page.locator("#chat-title")).to_have_text("New chat")
    writes = [c for c in calls if not c.startswith("GET")]
    assert writes == [f"POST /api/sessions/{session_id}/cancel", f"DELETE /api/sessions/{session_id}"], calls
    async with mesh.http() as http:
        assert (await http.get(f"/api/sessions/{session_id}")).status_code == 404
    # Its link now says so (Back goes to it).
    await page.go_back()
    await expect(page.locator(".not-found")).to_contain_text("This chat no longer exists.", timeout=T)
