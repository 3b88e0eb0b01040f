"""Retry, regenerate and edit on the last turn, in a real browser: each is a new turn that branches from
the parent of the turn's user message (POST /api/chat with `parentSequence`), the previous version stays
one click away (a "1/2" switcher), and the path shown follows the newest branch. The switcher is built from
GET /api/sessions/{id}/messages?mode=all (every message with its `sequence` and `parentSequence`)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from playwright.async_api import Page, Request, Response, expect

from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh

PACE = 30
SLOW = " ".join(f"again{i}" for i in range(60))  # 2 s at PACE
RULES: dict[str, Any] = {
    "rules": [
        {"system": r"\[general\]", "user": "^regen me", "text": "the first answer", "times": 1},
        {"system": r"\[general\]", "user": "^regen me", "text": SLOW, "tokens_per_second": PACE},
        {"system": r"\[general\]", "user": "^edited", "text": SLOW, "tokens_per_second": PACE},
        {"system": r"\[general\]", "user": "^stop me", "text": SLOW * 5, "tokens_per_second": PACE},
    ],
    "default": {"text": "Answer to: {user}"},
}


pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG)


def chat_post(r: Request) -> bool:
    return r.method == "POST" and r.url.endswith("/api/chat")


async def body_of(response: Response) -> dict[str, Any]:
    return dict(json.loads(response.request.post_data or "{}"))


async def branched(page: Page, response: Response) -> None:
    """The server took the branch (POST /api/chat with parentSequence)."""
    assert response.ok, response.status


async def test_the_switcher_shows_every_version_of_a_turn(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "branch me")
    await expect(reply.locator(".content")).to_have_text("Answer to: branch me", timeout=T)
    session_id = page.url.split("#/s/")[1]
    await expect(reply.locator(".branch")).to_have_count(0)  # one version: no switcher

    # A second version of the first turn, stored beside the first (a branch from the root).
    async with mesh.http() as http:
        resp = await http.post(
            f"/api/traces/{session_id}/messages",
            json={
                "parentSequence": 0,
                "messages": [
                    {"role": "user", "content": "branch me"},
                    {"role": "assistant", "content": "a newer answer", "status": "completed"},
                ],
            },
        )
        assert resp.status_code == 200, resp.text
    await page.reload()
    last = page.locator(".msg.assistant").last
    # The path follows the newest branch.
    await expect(last.locator(".content")).to_have_text("a newer answer", timeout=T)
    await expect(page.locator(".msg")).to_have_count(2)
    await expect(last.locator(".branch-pos")).to_have_text("2/2")
    await expect(last.locator(".branch-next")).to_be_disabled()

    await last.get_by_role("button", name="Previous version").click()
    last = page.locator(".msg.assistant").last
    await expect(last.locator(".content")).to_have_text("Answer to: branch me")
    await expect(last.locator(".branch-pos")).to_have_text("1/2")
    await expect(page.locator(".msg")).to_have_count(2)
    await last.get_by_role("button", name="Next version").click()
    await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text("a newer answer")

    # A message sent while an older version is shown continues that version.
    await page.locator(".msg.assistant").last.get_by_role("button", name="Previous version").click()
    async with page.expect_response(lambda r: chat_post(r.request)) as answer:
        await send(page, "follow up")
    response = await answer.value
    body = await body_of(response)
    assert body["traceId"] == session_id and body["parentSequence"] == 2, body
    if response.status == 422:
        await expect(page.locator("#input")).to_have_value("follow up")  # nothing typed is lost
        await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text(
            "Answer to: branch me"
        )
    await branched(page, response)
    await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text(
        "Answer to: follow up", timeout=T
    )
    await expect(page.locator(".msg.assistant").first.locator(".branch-pos")).to_have_text("1/2")


async def test_regenerate_streams_a_new_version_and_keeps_the_old_one(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "regen me")
    await expect(reply.locator(".content")).to_have_text("the first answer", timeout=T)
    session_id = page.url.split("#/s/")[1]
    regenerate = reply.get_by_role("button", name="Regenerate")
    async with page.expect_response(lambda r: chat_post(r.request)) as answer:
        await regenerate.click()
    response = await answer.value
    body = await body_of(response)
    assert body == {
        "agent": "general",
        "message": "regen me",
        "traceId": session_id,
        "parentSequence": 0,
    }, body
    if response.status == 422:  # the chat is as it was
        await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text("the first answer")
        await expect(page.locator(".msg")).to_have_count(2)
    await branched(page, response)

    last = page.locator(".msg.assistant").last
    await expect(last.locator(".content")).to_contain_text("again3", timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(1)  # it streams, live
    await expect(page.locator(".msg")).to_have_count(2)  # in place of the old version
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await expect(last.locator(".branch-pos")).to_have_text("2/2", timeout=T)
    await last.get_by_role("button", name="Previous version").click()
    await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text("the first answer")
    await page.reload()  # the newest version is the one shown
    await expect(page.locator(".msg.assistant").last.locator(".content")).to_contain_text(
        "again59", timeout=T
    )


async def test_a_cancelled_turn_offers_retry_and_edit(page: Page, mesh: Mesh) -> None:
    await sign_in(page, mesh)
    reply = await send(page, "stop me")
    await expect(reply.locator(".content")).to_contain_text("again2", timeout=T)
    await expect(reply.get_by_role("button", name="Retry")).to_have_count(0)  # not while it runs
    await page.click("#cancel")
    await expect(reply.locator(".msg-error")).to_have_text("This reply was cancelled.", timeout=T)
    await expect(reply.get_by_role("button", name="Retry")).to_be_visible()
    await expect(reply.locator(".content")).to_contain_text("again2")  # what it wrote stays

    user = page.locator(".msg.user").last
    await user.get_by_role("button", name="Edit").click()
    box = user.get_by_role("textbox", name="Edit your message")
    await expect(box).to_be_focused()
    await expect(box).to_have_value("stop me")
    await box.press("Escape")  # Escape leaves it as it was
    await expect(user.locator(".content")).to_have_text("stop me")
    await user.get_by_role("button", name="Edit").click()
    await box.fill("edited question")
    async with page.expect_response(lambda r: chat_post(r.request)) as answer:
        await box.press("Enter")
    response = await answer.value
    body = await body_of(response)
    assert body["message"] == "edited question" and body["parentSequence"] == 0, body
    await branched(page, response)
    await expect(page.locator(".msg.user").last.locator(".content")).to_have_text("edited question")
    last = page.locator(".msg.assistant").last
    await expect(last.locator(".content")).to_contain_text("again3", timeout=T)
    await expect(page.locator(".msg.streaming")).to_have_count(0, timeout=T)
    await expect(last.locator(".branch-pos")).to_have_text("2/2", timeout=T)
    await last.get_by_role("button", name="Previous version").click()
    await expect(page.locator(".msg.user").last.locator(".content")).to_have_text("stop me")
    await expect(page.locator(".msg.assistant").last.locator(".msg-error")).to_have_text(
        "This reply was cancelled."
    )
