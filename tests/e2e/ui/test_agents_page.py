"""The agents page in a real browser against a whole mesh, on both backend pairs: create an agent in
the page (every section: prompt and model, tools, limits, agent-invoke, subagents), chat with it, edit
its prompt and see the next turn use it; a change made elsewhere meanwhile is refused and shown, a bad
value shows the gateway's message, a built-in is read-only and cloned to change, delete. The test takes
the README's picture of the page (tests/e2e/ui/screenshots/agents.png)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from playwright.async_api import Page, expect

from tests.mesh import BACKENDS, Mesh, system_of, wait_request

T = 15_000  # ms: the longest any page condition may take
FIRST, SECOND = "You are the first prompt.", "You are the second prompt."
RULES: dict[str, Any] = {"rules": [], "default": {"text": "Reply: {user}"}}


# A user of the module's own: the PostgreSQL database is shared by the run's meshes.
pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, user="page")


async def sign_in(page: Page, mesh: Mesh) -> None:
    await page.goto(f"{mesh.url}/")
    await page.fill("#api-key", mesh.api_key)
    await page.click("#signin-form button[type=submit]")
    await expect(page.locator("#app")).to_be_visible(timeout=T)


async def agent(mesh: Mesh, slug: str) -> dict[str, Any]:
    async with mesh.http() as http:
        resp = await http.get(f"/api/agents/{slug}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json()["agent"])


def last_user(body: dict[str, Any]) -> str:
    return str([m for m in body["messages"] if m["role"] == "user"][-1]["content"])


async def test_create_chat_edit_and_the_next_turn_uses_the_edit(page: Page, mesh: Mesh, shots: Path) -> None:
    await sign_in(page, mesh)
    await page.click("#open-agents")
    await expect(page.locator("#agents-page")).to_be_visible()
    await expect(page.locator("main.chat")).to_be_hidden()
    await expect(page.locator('#builtin-agents [data-slug="general"]')).to_be_visible(timeout=T)
    await expect(page.locator("#own-agents [data-slug]")).to_have_count(0)

    # Create one, every section filled in from the options the page got.
    await page.click("#agent-new")
    await page.fill("#agent-slug", "tester")
    await page.fill("#agent-name", "Tester")
    await page.fill("#agent-prompt", FIRST)
    tools = page.locator('[data-choices="tools"] label')
    await expect(tools).to_have_count(4)
    await expect(tools.filter(has_text="clarify").locator(".badge")).to_have_text(["chat"])
    await page.check('input[name="tools"][value="agent-invoke"]')
    await page.check('input[name="tools"][value="delegate_task"]')
    await page.fill('input[name="limits.maxSteps"]', "5")
    await page.check('input[name="callees"][value="coder"]')
    await page.fill('input[name="invoke.maxParallel"]', "2")
    await page.select_option("#sub-enabled", "on")
    await page.fill('input[name="subagentConfig.maxConcurrent"]', "2")
    await page.check('input[name="preset-mode"][value="only"]')
    await page.check('input[name="presets"][value="coder"]')
    await page.check('input[name="subtool-mode"][value="only"]')
    await page.check('input[name="subtools"][value="agent-invoke"]')
    await page.click("#agent-save")
    await expect(page.locator("#agent-status")).to_have_text("Saved · version 1", timeout=T)
    await expect(page.locator('#own-agents [data-slug="tester"]')).to_be_visible()
    saved = await agent(mesh, "tester")
    assert (saved["systemPrompt"], saved["tools"], saved["limits"]["maxSteps"]) == (
        FIRST,
        ["agent-invoke", "delegate_task"],
        5,
    )
    assert (saved["invoke"]["allowedCallees"], saved["invoke"]["maxParallel"]) == (["coder"], 2)
    assert saved["subagentConfig"] == {
        "enabled": True,
        "maxConcurrent": 2,
        "allowedPresetAgentIds": ["coder"],
        "allowedToolNames": ["agent-invoke"],
    }
    await expect(page.locator('#agent optgroup[label="Your agents"] option')).to_have_text(["Tester"])

    # Chat with it.
    await page.click("#agent-chat")
    await expect(page.locator("main.chat")).to_be_visible()
    await expect(page.locator("#agent")).to_have_value("tester", timeout=T)
    start = len(mesh.mock.requests())
    await page.fill("#input", "hello from the page")
    await page.press("#input", "Enter")
    reply = page.locator(".msg.assistant").last
    await expect(reply.locator(".content")).to_have_text("Reply: hello from the page", timeout=T)
    body = await wait_request(mesh.mock, lambda b: last_user(b) == "hello from the page", start=start)
    assert system_of(body) == FIRST

    # Edit its prompt in the page; the next turn of the same chat uses it, nothing restarted.
    await page.click("#open-agents")
    await page.click('#own-agents [data-slug="tester"] button')
    await expect(page.locator("#agent-version")).to_have_text("version 1")
    await page.fill("#agent-prompt", SECOND)
    await page.click("#agent-save")
    await expect(page.locator("#agent-status")).to_have_text("Saved · version 2", timeout=T)
    await expect(page.locator("#agent-version")).to_have_text("version 2")
    await page.set_viewport_size({"width": 1280, "height": 1000})
    await page.locator(".agent-editor").evaluate("editor => { editor.scrollTop = 0; }")
    await page.screenshot(path=str(shots / "agents.png"))
    await page.set_viewport_size({"width": 1280, "height": 800})

    await page.locator("#sessions .session-open").first.click()
    await expect(page.locator("main.chat")).to_be_visible()
    await expect(page.locator(".msg.assistant .content")).to_have_text(
        ["Reply: hello from the page"], timeout=T
    )
    start = len(mesh.mock.requests())
    await page.fill("#input", "the next turn")
    await page.press("#input", "Enter")
    await expect(page.locator(".msg.assistant").last.locator(".content")).to_have_text(
        "Reply: the next turn", timeout=T
    )
    body = await wait_request(mesh.mock, lambda b: last_user(b) == "the next turn", start=start)
    assert system_of(body) == SECOND
    assert [m["content"] for m in body["messages"] if m["role"] == "user"] == [
        "hello from the page",
        "the next turn",
    ]


async def test_stale_and_bad_writes_builtins_clone_and_delete(page: Page, mesh: Mesh) -> None:
    async with mesh.http() as http:
        created = await http.post("/api/agents", json={"slug": "shared", "name": "Shared"})
        assert created.status_code == 201
    await sign_in(page, mesh)
    await page.goto(f"{mesh.url}/#/agents/shared")
    await page.reload()
    await expect(page.locator("#agent-title")).to_have_text("Shared", timeout=T)

    # Changed elsewhere (another tab, the CLI) after the page read it: the save is refused, not lost.
    async with mesh.http() as http:
        elsewhere = await http.patch("/api/agents/shared", json={"description": "from the CLI"})
        assert elsewhere.status_code == 200
    await page.fill("#agent-prompt", "from the page")
    await page.click("#agent-save")
    error = page.locator("#agent-error")
    await expect(error).to_contain_text("Changed elsewhere", timeout=T)
    await expect(error).to_contain_text("agent 'shared' is at version 2, not 1")
    assert (await agent(mesh, "shared"))["systemPrompt"] != "from the page"
    await page.click("#agent-reload")
    await expect(page.locator("#agent-version")).to_have_text("version 2", timeout=T)
    await expect(page.locator("#agent-description")).to_have_value("from the CLI")

    # A value out of range: the gateway's message, and nothing saved.
    await page.fill('input[name="limits.maxSteps"]', "1000")
    await page.click("#agent-save")
    await expect(page.locator("#agent-error")).to_have_text("limits.maxSteps must be 1-100", timeout=T)
    assert (await agent(mesh, "shared"))["version"] == 2

    # A built-in is read-only; its clone is the user's to change.
    await page.click('#builtin-agents [data-slug="general"] button')
    await expect(page.locator("#agent-readonly")).to_be_visible()
    await expect(page.locator("#agent-save")).to_have_count(0)
    await expect(page.locator("#agent-prompt")).to_be_disabled()
    await page.click("#agent-clone")
    await expect(page.locator("#agent-status")).to_have_text("Cloned from general", timeout=T)
    await expect(page.locator("#agent-title")).to_have_text("General Assistant (copy)")
    await expect(page.locator("#agent-slug")).to_have_value("general-copy")
    await expect(page.locator("#agent-prompt")).to_be_enabled()
    await expect(page.locator('#agent optgroup[label="Your agents"] option')).to_contain_text(
        ["General Assistant (copy)"], timeout=T
    )

    # Delete it (after the confirmation).
    page.once("dialog", lambda dialog: dialog.accept())
    await page.click("#agent-delete")
    await expect(page.locator('#own-agents [data-slug="general-copy"]')).to_have_count(0, timeout=T)
    await expect(page.locator('#agent option[value="general-copy"]')).to_have_count(0, timeout=T)
    async with mesh.http() as http:
        assert (await http.get("/api/agents/general-copy")).status_code == 404
