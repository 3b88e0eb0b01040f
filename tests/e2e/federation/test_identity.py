"""A copy keeps the home's identity (docs/federation.md#what-a-copy-shows): a peer's trace read through
our cached copy shows each message exactly as its home does (id, sequence, parent, create time, source,
task, caller agent) with the caller trace in a form that means something here (`@peer/<id>`)."""

from __future__ import annotations

from typing import Any

from tests.e2e.federation.conftest import Fed
from tests.e2e.federation.test_continuation import tool_output
from tests.e2e.federation.test_reads import append
from tests.mesh import Mesh, chat

SAME = ("id", "sequence", "parentSequence", "createTime", "role", "content", "status", "source", "a2aTaskId")


async def all_messages(mesh: Mesh, trace_id: str) -> list[dict[str, Any]]:
    async with mesh.http() as http:
        resp = await http.get(f"/api/traces/{trace_id}/messages", params={"mode": "all", "limit": 1000})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["messages"])


async def test_a_copy_shows_each_message_as_its_home_does(fed: Fed) -> None:
    # at org B, its general agent calls its own coder: the callee's trace has a caller agent and trace
    out = tool_output(await chat(fed.orgb, "general", "remote-invoke coder keep me as I am"))
    assert out["ok"] is True, out
    callee = out["traceId"]
    await append(fed.orgb, callee, ["one more"])
    home = await all_messages(fed.orgb, callee)
    first = await all_messages(fed.cloud, f"@orgb/{callee}")
    await append(fed.orgb, callee, ["and a late one"])  # the next read syncs incrementally
    home_after = await all_messages(fed.orgb, callee)
    again = await all_messages(fed.cloud, f"@orgb/{callee}")
    assert len(first) == len(home) >= 3 and len(again) == len(home_after) == len(home) + 1
    for copied, at_home in [*zip(first, home, strict=True), *zip(again, home_after, strict=True)]:
        for key in SAME:
            assert copied.get(key) == at_home.get(key), (key, copied, at_home)
        assert copied["traceId"] == f"@orgb/{callee}"
        assert copied.get("callerAgent") == at_home.get("callerAgent")
        caller = at_home.get("callerTraceId")
        assert copied.get("callerTraceId") == (f"@orgb/{caller}" if caller else caller), (copied, at_home)
    assert any(m.get("callerAgent") == "general" and m.get("callerTraceId") for m in home), home
