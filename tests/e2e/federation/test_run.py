"""POST /api/traces/{id}/run takes every id form (docs/federation.md#trace-ids): a peer's trace is
continued at its home, relayed (JSON or SSE) under its location-bearing id; an id naming this mesh's own
address is one of its traces; one answer code per kind of refusal, on every route."""

from __future__ import annotations

import json
from typing import Any

from tests.e2e.federation.conftest import Fed
from tests.e2e.federation.test_identity import all_messages
from tests.e2e.federation.test_reads import new_trace


def data_events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]


async def test_run_on_a_peers_trace_runs_at_its_home(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 0)
    port = fed.orgb.url.rsplit(":", 1)[1]
    async with fed.cloud.http() as http:
        answer = await http.post(f"/api/traces/@orgb/{tid}/run", json={"input": "go on"})
        streamed = await http.post(
            f"/api/traces/agent%3A%2F%2F127.0.0.1%3A{port}%2F{tid}/run",
            json={"input": "and stream"},
            headers={"Accept": "text/event-stream"},
        )
        missing = await http.post("/api/traces/@orgb/no-such-trace/run", json={"input": "x"})
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["ok"] is True and result["output"] == "coder says: go on", result
    assert result["traceId"] == f"@orgb/{tid}"
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = data_events(streamed.text)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and "text-delta" in kinds and "finish" in kinds, kinds
    assert events[0]["traceId"] == f"@orgb/{tid}"
    assert "".join(e["textDelta"] for e in events if e["type"] == "text-delta") == "coder says: and stream"
    home = await all_messages(fed.orgb, tid)
    assert [m["content"] for m in home][-4:] == [
        "go on",
        "coder says: go on",
        "and stream",
        "coder says: and stream",
    ]
    assert result["messageId"] == home[-3]["id"]  # the assistant message, by its id at home
    assert missing.status_code == 404, missing.text


async def test_an_id_naming_this_mesh_is_one_of_its_traces(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 1)
    port = fed.orgb.url.rsplit(":", 1)[1]
    own = f"agent%3A%2F%2F127.0.0.1%3A{port}%2F{tid}"
    async with fed.orgb.http() as http:
        got = await http.get(f"/api/traces/{own}")
        page = await http.get(f"/api/traces/{own}/messages")
        appended = await http.post(
            f"/api/traces/{own}/messages", json={"messages": [{"role": "user", "content": "mine"}]}
        )
        ran = await http.post(f"/api/traces/{own}/run", json={"input": "me too"})
    assert got.status_code == 200 and got.json()["trace"]["id"] == tid and got.json()["stale"] is False
    assert page.status_code == 200 and appended.status_code == 200, appended.text
    assert ran.status_code == 200 and ran.json()["ok"] is True and ran.json()["traceId"] == tid, ran.text


async def test_an_unregistered_peer_is_refused_alike_on_every_route(fed: Fed) -> None:
    canary = f"agent%3A%2F%2F127.0.0.1%3A{fed.canary.port}%2Fx"  # unregistered as 127.0.0.1
    before = fed.canary.connections
    note = {"messages": [{"role": "user", "content": "x"}]}
    async with fed.cloud.http() as http:
        for ref in ("@nobody/x", canary):
            answers = {
                "read": await http.get(f"/api/traces/{ref}"),
                "messages": await http.get(f"/api/traces/{ref}/messages"),
                "append": await http.post(f"/api/traces/{ref}/messages", json=note),
                "run": await http.post(f"/api/traces/{ref}/run", json={"input": "x"}),
            }
            for route, resp in answers.items():
                assert resp.status_code == 403, (ref, route, resp.text)
                assert resp.json()["error"]["reason"] == "PERMISSION_DENIED", (ref, route)
    assert fed.canary.connections == before  # refused before any connection


async def test_a_peers_run_streams_live_with_its_model_slowed(fed: Fed) -> None:
    """The relay passes each event on as it comes: the first words arrive long before the turn ends."""
    import time

    from tests.e2e.federation.conftest import RULES
    from tests.mesh import sse_events

    tid = await new_trace(fed.orgb, 0)
    slow = {
        **RULES,
        "rules": [{"system": r"\[coder\]", "text": "slow " * 40, "tokens_per_second": 40}, *RULES["rules"]],
    }
    fed.orgb.mock.set_rules(slow)
    first: float | None = None
    try:
        async with fed.cloud.http() as http:
            started = time.monotonic()
            async with http.stream(
                "POST", f"/api/traces/@orgb/{tid}/run", json={"input": "slowly"},
                headers={"Accept": "text/event-stream"},
            ) as resp:  # fmt: skip
                assert resp.status_code == 200
                text = []
                async for event in sse_events(resp):
                    if event["type"] == "text-delta":
                        first = first or time.monotonic()
                        text.append(event["textDelta"])
            ended = time.monotonic()
    finally:
        fed.orgb.mock.set_rules(RULES)
    assert first is not None and "".join(text).strip() == ("slow " * 40).strip()
    assert first - started < (ended - started) / 2, (first - started, ended - started)
