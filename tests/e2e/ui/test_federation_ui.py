"""The side panel with a peer's agent, in a real browser: an agent-invoke of `@orgb/coder` (over A2A)
opens the panel and its text grows live before the tool ends; from the history the call opens our copy
of the exchange, a continuation there (the peer's /run) opens the peer's trace through this mesh's trace
API by its location-bearing id, and with the peer gone it still opens, from the cached copy, saying so."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from playwright.async_api import Page, expect

from agentmesh.libs.config import StreamSettings
from tests.e2e.ui.test_ui import T, send, sign_in
from tests.mesh import TEST_CATALOG, Mesh, Ports, start_mesh

STORY = "A story from the other mesh: " + " ".join(f"word{i}" for i in range(60))
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": r"continue (?P<slug>\S+) (?P<trace>\S+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "agent-invoke",
                    "arguments": {"agentSlug": "{slug}", "input": "{rest}", "continueFrom": "{trace}"},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": r"invoke (?P<slug>\S+): (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "{slug}", "input": "{rest}"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "All done."},
        {"system": r"\[coder\]", "text": STORY, "tokens_per_second": 20},
    ],
    "default": {"text": "ok"},
}


@dataclass
class Pair:
    cloud: Mesh
    orgb: Mesh


@pytest.fixture(scope="module")
async def pair(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pair]:
    tmp = tmp_path_factory.mktemp("fed-ui")
    ports = Ports()
    b_port = ports.take()
    env = f"FEDUI_{uuid.uuid4().hex[:8].upper()}"
    catalog = yaml.safe_load(TEST_CATALOG.read_text())
    for agent in catalog["agents"]:
        if agent["slug"] == "general":
            agent["invoke"]["allowedCallees"].append("@orgb/coder")
        if agent["slug"] == "coder":
            agent["public"] = True  # served over A2A to other meshes
    (tmp / "catalog.yaml").write_text(yaml.safe_dump(catalog))
    (tmp / "peers.yaml").write_text(
        yaml.safe_dump({"peers": {"orgb": {"url": f"http://127.0.0.1:{b_port}", "credential": env}}})
    )
    quick = StreamSettings(ttl_s=1.0, heartbeat_s=5)
    orgb = await start_mesh(tmp / "b", rules=RULES, catalog=tmp / "catalog.yaml", gateway_port=b_port)
    os.environ[env] = orgb.api_key  # set before the start: an unset credential variable stops it
    cloud = await start_mesh(
        tmp / "a", rules=RULES, catalog=tmp / "catalog.yaml", stream=quick, peers=str(tmp / "peers.yaml"),
        federation={"down_s": 0, "read_retries": 0},
    )  # fmt: skip
    yield Pair(cloud, orgb)
    os.environ.pop(env, None)
    await cloud.stop()
    await orgb.stop()
    ports.release()


async def test_the_panel_follows_a_peers_agent_and_reopens_its_trace(
    page: Page, pair: Pair, tmp_path: Path
) -> None:
    await sign_in(page, pair.cloud)
    reply = await send(page, "invoke @orgb/coder: tell me a story")
    panel_text = page.locator("#invoke-body .panel-text")
    await expect(panel_text).to_contain_text("word3", timeout=T)
    badge = reply.locator('.tool[data-tool="agent-invoke"] .badge')
    assert await badge.inner_text() == "running", "the peer's text came while the tool still ran"
    # the card's "open", live: a2a-task-started names the peer's trace (traceId) and our record
    # (localTraceId); the card opens the record, which reads with the peer gone too
    live_open = await reply.locator('.tool[data-tool="agent-invoke"] .open-trace').evaluate(
        "b => b.detail.traceId"
    )
    await expect(badge).to_have_text("completed", timeout=T)
    await expect(panel_text).to_contain_text("word59")
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)

    # the first call went over A2A: the history opens our copy of the exchange (localTraceId)
    await page.reload()
    first = page.locator(".msg.assistant").first.locator('.tool[data-tool="agent-invoke"]')
    await first.locator(".open-trace").click()
    panel = page.locator("#invoke-panel")
    await expect(panel.locator(".panel-text")).to_contain_text("word59", timeout=T)

    # continue the peer's trace with the peer's agent (its /run): the call's traceId is the peer's trace,
    # and the history opens our record of the exchange (localTraceId), also with the peer gone
    async with pair.cloud.http() as http:
        session = (await http.get("/api/sessions")).json()["sessions"][0]["id"]
        messages = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    calls = [c for m in messages for c in (m.get("metadata") or {}).get("toolCalls", [])]
    ref = calls[0]["output"]["traceId"]
    assert ref.startswith("@orgb/"), calls[0]
    assert live_open == calls[0]["output"]["localTraceId"] == calls[0]["metadata"]["localTraceId"], calls[0]
    reply = await send(page, f"continue @orgb/coder {ref}: and then?")
    await expect(reply.locator(".content")).to_have_text("All done.", timeout=T)
    async with pair.cloud.http() as http:
        messages = (await http.get(f"/api/sessions/{session}/messages")).json()["messages"]
    out = [c for m in messages for c in (m.get("metadata") or {}).get("toolCalls", [])][-1]["output"]
    assert out["traceId"] == ref and out["localTraceId"] and out["remote"] is True, out
    assert pair.orgb.gateway is not None
    await pair.orgb.gateway.stop()
    pair.orgb.gateway = None
    await page.reload()
    second = page.locator(".msg.assistant").last.locator('.tool[data-tool="agent-invoke"]')
    await second.locator(".open-trace").click()
    await expect(panel.locator(".panel-task")).to_contain_text("and then?", timeout=T)
    await expect(panel.locator(".panel-text")).to_contain_text("word59", timeout=T)
