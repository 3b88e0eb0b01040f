"""Issue 38 on the three meshes of conftest.py (org A's cloud and terminal on one PostgreSQL database,
org B on its own SQLite database), as a client of org A sees them (docs/federation.md):

- one meaning for `traceId` (docs/federation.md#trace-ids-in-events-and-results): the trace where the
  callee's turn ran, location-bearing when that is a peer's, the same in `a2a-task-started`, the tool
  result and the stored tool call, from whichever mesh of org A reads it; our record of a remote
  exchange only as `localTraceId`;
- an append through every id a client obtains reaches the trace's home (point 1);
- a cached read with the peer hung answers from the copy within 1 s, `stale: true` (point 2);
- a copy shows the home's message ids, create times, caller agent and caller trace (point 3).
"""

from __future__ import annotations

import time
from typing import Any

from tests.e2e.federation.conftest import Fed
from tests.e2e.federation.test_appends import copy_id_of, note
from tests.e2e.federation.test_continuation import tool_output
from tests.e2e.federation.test_identity import all_messages
from tests.e2e.federation.test_reads import new_trace
from tests.mesh import Mesh, chat, wait_until

SAME = ("id", "sequence", "parentSequence", "createTime", "role", "content", "source", "a2aTaskId")


def ids_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The ids one agent-invoke call handed its client: the event, the result, the tool's metadata."""
    started = [e for e in events if e["type"] == "a2a-task-started"]
    outputs = [e for e in events if e["type"] == "tool-output-available"]
    assert len(started) == 1 and len(outputs) == 1, [e["type"] for e in events]
    kinds = [e["type"] for e in events]
    assert kinds.index("a2a-task-started") < kinds.index("tool-output-available")
    out = tool_output(events)
    assert out["ok"] is True, out
    return {"started": started[0], "out": out, "meta": outputs[0]["metadata"], "chat": events[0]["traceId"]}


def same_everywhere(call: dict[str, Any], trace_id: str, local: str | None) -> None:
    for where in ("started", "out", "meta"):
        assert call[where]["traceId"] == trace_id, (where, call[where])
        assert (call[where].get("localTraceId") or None) == local, (where, call[where])  # absent or ""


async def stored_call(mesh: Mesh, chat_id: str) -> dict[str, Any]:
    """The agent-invoke call as `mesh` reads it back from the caller's chat."""
    async with mesh.http() as http:
        resp = await http.get(f"/api/sessions/{chat_id}/messages", params={"limit": 1000})
    assert resp.status_code == 200, resp.text
    calls = [c for m in resp.json()["messages"] for c in (m.get("metadata") or {}).get("toolCalls", [])]
    assert len(calls) == 1, calls
    return dict(calls[0])


async def test_trace_id_means_where_the_callee_ran_in_the_event_the_result_and_the_record(fed: Fed) -> None:
    # a new call of a peer's agent: the peer's trace, learned from the peer, in all three places
    first = ids_of(await chat(fed.cloud, "general", "remote-invoke @orgb/coder where do you run"))
    ref = first["out"]["traceId"]
    record = first["out"]["localTraceId"]
    assert ref.startswith("@orgb/") and "/" not in record and first["out"]["remote"] is True
    same_everywhere(first, ref, record)
    at_home = await all_messages(fed.orgb, ref.split("/", 1)[1])
    assert [m["content"] for m in at_home] == ["where do you run", "coder says: where do you run"]
    # the record: a trace of org A (either of its meshes reads it) with the exchange
    assert [m["content"] for m in await all_messages(fed.terminal, record)][-1] == at_home[-1]["content"]
    # stored: the terminal reads the cloud's chat through the shared database, with the same ids
    stored = await stored_call(fed.terminal, first["chat"])
    assert stored["output"]["traceId"] == stored["metadata"]["traceId"] == ref, stored
    assert stored["output"]["localTraceId"] == stored["metadata"]["localTraceId"] == record, stored

    # continued there by the peer's agent (its /run), from the other mesh of org A: the same trace
    there = ids_of(await chat(fed.terminal, "general", f"remote-continue @orgb/coder {ref} and next"))
    assert there["out"]["localTraceId"] not in ("", record)
    same_everywhere(there, ref, there["out"]["localTraceId"])

    # continued here by one of our agents (on our copy, the turn sent home): the same trace, no record
    here = ids_of(await chat(fed.cloud, "general", f"remote-continue coder {ref} and here"))
    same_everywhere(here, ref, None)
    assert [m["content"] for m in await all_messages(fed.orgb, ref.split("/", 1)[1])][-4:] == [
        "and next",
        "coder says: and next",
        "and here",
        "coder says: and here",
    ]

    # an agent of ours: a trace of org A, local to both of its meshes
    local = ids_of(await chat(fed.cloud, "general", "remote-invoke coder right here"))
    same_everywhere(local, local["out"]["traceId"], None)
    assert "/" not in local["out"]["traceId"] and "remote" not in local["out"]
    assert (await stored_call(fed.terminal, local["chat"]))["metadata"]["traceId"] == local["out"]["traceId"]


async def test_an_append_through_every_id_a_client_obtains_reaches_home(fed: Fed) -> None:
    # at org B its general calls its coder: the callee trace has a caller trace there
    made = tool_output(await chat(fed.orgb, "general", "remote-invoke coder at home"))
    tid = made["traceId"]
    # ids org A's client obtains for org B's traces: a peer's agent called over A2A as a catalogued
    # remote agent (agent://), as a registered peer's (@orgb/), and the ids read through the copy
    catalogued = tool_output(await chat(fed.cloud, "general", "remote-invoke b-coder by its card"))
    address = catalogued["traceId"]
    assert address.startswith("agent://127.0.0.1:") and catalogued["remote"] is True, catalogued
    copied = await all_messages(fed.cloud, f"@orgb/{tid}")
    caller = next(m["callerTraceId"] for m in copied if m.get("callerTraceId"))
    assert caller.startswith("@orgb/"), copied
    targets = {  # name -> (the mesh of org A appending, the id it appends to, the home id at org B)
        "copy's traceId": (fed.cloud, copied[0]["traceId"], tid),
        "callerTraceId": (fed.cloud, caller, caller.split("/", 1)[1]),
        "agent:// from a result": (fed.cloud, address, address.rsplit("/", 1)[1]),
        "@orgb/ on the terminal": (fed.terminal, f"@orgb/{tid}", tid),
    }
    acked: dict[str, dict[str, Any]] = {}
    for name, (mesh, ref, _) in targets.items():
        async with mesh.http() as http:
            resp = await http.post(f"/api/traces/{ref}/messages", json=note(f"via {name}"))
        assert resp.status_code == 200, (name, resp.text)
        acked[name] = resp.json()["messages"][0]
    # our copy's own id (never handed out) reads the copy, and takes no append and no turn (naming the
    # home id): they would never reach home
    copy_id = await copy_id_of(fed, f"@orgb/{tid}")
    async with fed.cloud.http() as http:
        read = await http.get(f"/api/traces/{copy_id}")
        refused = await http.post(f"/api/traces/{copy_id}/messages", json=note("via the copy's id"))
        no_run = await http.post(f"/api/traces/{copy_id}/run", json={"input": "via the copy's id"})
        # our record of a remote exchange (localTraceId) is a trace of ours: its append stays here
        kept = await http.post(
            f"/api/traces/{catalogued['localTraceId']}/messages", json=note("in the record")
        )
    assert read.status_code == 200 and read.json()["trace"]["home"] == f"@orgb/{tid}", read.text
    assert refused.status_code == 409 and f"@orgb/{tid}" in refused.json()["error"]["message"], refused.text
    assert no_run.status_code == 422 and f"@orgb/{tid}" in no_run.json()["error"]["message"], no_run.text
    assert kept.status_code == 200, kept.text
    record = await all_messages(fed.terminal, catalogued["localTraceId"])  # org A's shared database
    assert record[-1]["id"] == kept.json()["messages"][0]["id"] and record[-1]["content"] == "in the record"
    assert "in the record" not in {
        m["content"] for m in await all_messages(fed.orgb, targets["agent:// from a result"][2])
    }
    for name, (_, _, home_id) in targets.items():
        at_home = {m["content"]: m for m in await all_messages(fed.orgb, home_id)}
        assert f"via {name}" in at_home, name
        assert acked[name]["id"] == at_home[f"via {name}"]["id"], name
        assert acked[name]["sequence"] == at_home[f"via {name}"]["sequence"], name
    assert "via the copy's id" not in {m["content"] for m in await all_messages(fed.orgb, tid)}


async def test_a_copy_keeps_the_homes_identity_on_either_mesh_of_org_a(fed: Fed) -> None:
    made = tool_output(await chat(fed.orgb, "general", "remote-invoke coder who called me"))
    tid = made["traceId"]
    home = await all_messages(fed.orgb, tid)
    assert any(m.get("callerAgent") == "general" and m.get("callerTraceId") for m in home), home
    for mesh in (fed.terminal, fed.cloud):
        copy = await all_messages(mesh, f"@orgb/{tid}")
        assert len(copy) == len(home)
        for copied, original in zip(copy, home, strict=True):
            for key in SAME:
                assert copied.get(key) == original.get(key), (key, copied, original)
            assert copied.get("callerAgent") == original.get("callerAgent")
            caller = original.get("callerTraceId")
            assert copied.get("callerTraceId") == (f"@orgb/{caller}" if caller else caller)
            assert copied["traceId"] == f"@orgb/{tid}"


async def test_a_cached_read_with_its_peer_hung_answers_stale_within_a_second(fed: Fed) -> None:
    """The terminal reads org B through `orgbh`, a relay that then accepts every request and never
    answers: the read waits for the peer at most the cached-read wait (0.8 s), then answers from the
    copy, whatever the hang's length (it has none)."""
    tid = await new_trace(fed.orgb, 2)
    ref = f"@orgbh/{tid}"
    async with fed.terminal.http() as http:
        fresh = await http.get(f"/api/traces/{ref}/messages")
        assert fresh.status_code == 200 and fresh.json()["stale"] is False, fresh.text
        fed.hung.hold()
        try:
            for path in (f"/api/traces/{ref}/messages", f"/api/traces/{ref}"):
                started = time.monotonic()
                resp = await http.get(path)
                took = time.monotonic() - started
                assert resp.status_code == 200, resp.text
                assert took < 1.0, (path, took)
                assert resp.json()["stale"] is True and resp.json()["syncTime"] == fresh.json()["syncTime"]
            assert (await http.get(f"/api/traces/{ref}/messages")).json()["messages"] == fresh.json()[
                "messages"
            ]
        finally:
            fed.hung.release()

        async def fresh_again() -> bool:
            resp = await http.get(f"/api/traces/{ref}/messages")
            return bool(resp.status_code == 200 and resp.json()["stale"] is False)

        await wait_until(fresh_again, timeout=15, what="the relay to answer again")


async def test_a_peer_that_never_took_the_call_leaves_our_record_as_its_trace(fed: Fed) -> None:
    """The peer is unreachable: no trace exists there, so the call names the one trace it has, our
    record, in the event (which comes at the call's end) and in the result alike."""
    await fed.proxy.down()
    try:
        events = await chat(fed.cloud, "general", "remote-invoke @orgbp/coder are you there")
    finally:
        await fed.proxy.up()
    started = [e for e in events if e["type"] == "a2a-task-started"]
    out = tool_output(events)
    assert out["ok"] is False and out["code"] == "unavailable", out
    assert len(started) == 1 and started[0]["traceId"] == out["traceId"], (started, out)
    assert "/" not in out["traceId"] and not started[0]["localTraceId"] and "localTraceId" not in out
    record = await all_messages(fed.cloud, out["traceId"])
    assert [m["content"] for m in record][:1] == ["are you there"] and record[-1]["status"] == "failed"
