"""Reading traces across meshes: hybrid (a shared PostgreSQL: local to each other, no HTTP) and remote
(org B over HTTP through the cached copy): all three id forms, paging, incremental sync, gzip, stale
reads from the cache when the peer is down, foreign ids."""

from __future__ import annotations

import secrets
from typing import Any

import httpx

from tests.e2e.federation.conftest import Fed
from tests.mesh import Mesh


async def new_trace(mesh: Mesh, n: int, api_key: str | None = None) -> str:
    """A chat trace on `mesh` with n messages appended over the trace API."""
    async with mesh.http(api_key) as http:
        created = await http.post("/api/chat", json={"agent": "coder", "message": "start"})
        assert created.status_code == 200
        trace_id = next(
            line for line in created.text.splitlines() if line.startswith("data:") and '"start"' in line
        )
    import json

    tid = json.loads(trace_id[5:])["traceId"]
    if n:
        await append(mesh, tid, [f"m{i}" for i in range(n)], api_key)
    return str(tid)


async def append(mesh: Mesh, trace_id: str, texts: list[str], api_key: str | None = None) -> Any:
    async with mesh.http(api_key) as http:
        for i in range(0, len(texts), 100):
            body = {"messages": [{"role": "user", "content": t} for t in texts[i : i + 100]]}
            resp = await http.post(f"/api/traces/{trace_id}/messages", json=body)
            assert resp.status_code == 200, resp.text
    return resp.json()


async def test_hybrid_meshes_of_one_org_read_each_others_traces_locally(fed: Fed) -> None:
    tid = await new_trace(fed.terminal, 3)
    async with fed.cloud.http() as http:
        got = await http.get(f"/api/traces/{tid}")
        page = await http.get(f"/api/traces/{tid}/messages")
    assert got.status_code == 200, got.text
    assert got.json()["trace"]["id"] == tid and got.json()["trace"]["home"] == ""
    assert [m["content"] for m in page.json()["messages"]][-3:] == ["m0", "m1", "m2"]
    assert page.json()["stale"] is False


async def test_a_peers_trace_by_every_id_form(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 5)
    port = fed.orgb.url.rsplit(":", 1)[1]
    async with fed.cloud.http() as http:
        for ref in (
            f"@orgb/{tid}",
            f"agent://127.0.0.1:{port}/{tid}",
            f"agent%3A%2F%2F127.0.0.1%3A{port}%2F{tid}",
        ):
            got = await http.get(f"/api/traces/{ref}")
            assert got.status_code == 200, (ref, got.text)
            body = got.json()
            assert body["trace"]["id"] == f"@orgb/{tid}" and body["trace"]["home"] == f"@orgb/{tid}"
            assert body["stale"] is False and body["syncTime"]
            page = await http.get(f"/api/traces/{ref}/messages", params={"mode": "all"})
            assert [m["content"] for m in page.json()["messages"]][-5:] == [f"m{i}" for i in range(5)]
            assert all(m["traceId"] == f"@orgb/{tid}" for m in page.json()["messages"])
        # a cached copy is never in the sidebar
        sessions = (await http.get("/api/sessions")).json()["sessions"]
    assert all(not s["home"] for s in sessions)


async def test_paging_incremental_sync_and_gzip(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 250)
    ref = f"@orgb/{tid}"
    async with fed.cloud.http() as http:
        first = await http.get(f"/api/traces/{ref}/messages", params={"limit": 100, "offset": 0})
        total = first.json()["total"]
        assert total >= 250 and len(first.json()["messages"]) == 100
        second = await http.get(f"/api/traces/{ref}/messages", params={"limit": 100, "offset": 100})
        seqs = [m["sequence"] for m in first.json()["messages"] + second.json()["messages"]]
        assert seqs == sorted(set(seqs)) and len(seqs) == 200
        head = first.json()["headSequence"]
        # new messages at home: the next read fetches only what is after the last sequence held
        await append(fed.orgb, tid, ["late-1", "late-2"])
        newer = await http.get(f"/api/traces/{ref}/messages", params={"since_sequence": head})
        assert [m["content"] for m in newer.json()["messages"]] == ["late-1", "late-2"]
        # gzip when the client accepts it
        raw = await http.get(
            f"/api/traces/{ref}/messages", params={"limit": 200}, headers={"Accept-Encoding": "gzip"}
        )
        assert raw.headers.get("content-encoding") == "gzip"
        assert len(raw.json()["messages"]) == 200
        plain = await http.get(
            f"/api/traces/{ref}/messages", params={"limit": 200}, headers={"Accept-Encoding": "identity"}
        )
        assert "content-encoding" not in plain.headers


async def test_foreign_and_unknown_ids_answer_like_missing_ones(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 1)
    bob = await fed.orgb.new_user("bob")
    async with fed.orgb.http(bob) as http:
        foreign = await http.get(f"/api/traces/{tid}")
        missing = await http.get("/api/traces/no-such-trace")
        foreign_msgs = await http.get(f"/api/traces/{tid}/messages")
        foreign_append = await http.post(
            f"/api/traces/{tid}/messages", json={"messages": [{"role": "user", "content": "x"}]}
        )
    assert foreign.status_code == missing.status_code == foreign_msgs.status_code == 404
    assert foreign_append.status_code == 404
    assert foreign.json() == missing.json()
    async with fed.cloud.http() as http:
        remote_missing = await http.get("/api/traces/@orgb/no-such-trace")
    assert remote_missing.status_code == 404


async def test_bad_ids_and_no_key(fed: Fed) -> None:
    async with fed.cloud.http() as http:
        for bad in ("a b", "agent://host", "@/x", "..x"):
            resp = await http.get(f"/api/traces/{bad}")
            assert resp.status_code == 422, (bad, resp.text)
            assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"
    async with httpx.AsyncClient(base_url=fed.cloud.url) as anon:
        assert (await anon.get("/api/traces/x")).status_code == 401


async def test_later_reads_fetch_only_what_is_new(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 0)
    await append(fed.orgb, tid, [secrets.token_hex(100) for _ in range(300)])  # gzip cannot shrink these
    ref = f"@orgbp/{tid}"  # org B behind the counting relay
    async with fed.cloud.http() as http:
        fed.proxy.bytes_back = 0
        assert (await http.get(f"/api/traces/{ref}/messages", params={"limit": 10})).status_code == 200
        full = fed.proxy.bytes_back
        await append(fed.orgb, tid, ["new"])
        fed.proxy.bytes_back = 0
        page = await http.get(f"/api/traces/{ref}/messages", params={"mode": "all", "limit": 1000})
        incremental = fed.proxy.bytes_back
    assert page.json()["messages"][-1]["content"] == "new" and page.json()["total"] >= 301
    assert incremental < full / 10, (incremental, full)  # one message, not 300 again


async def test_peer_down_reads_come_from_the_cache_marked_stale(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 4)
    ref = f"@orgbp/{tid}"
    async with fed.cloud.http() as http:
        fresh = await http.get(f"/api/traces/{ref}/messages")
        await fed.proxy.down()
        try:
            stale = await http.get(f"/api/traces/{ref}/messages")
            trace = await http.get(f"/api/traces/{ref}")
            refused = await http.post(
                f"/api/traces/{ref}/messages", json={"messages": [{"role": "user", "content": "while down"}]}
            )
            never_read = await http.get(f"/api/traces/@orgbp/{tid}x")
        finally:
            await fed.proxy.up()
        again = await http.get(f"/api/traces/{ref}/messages")
    assert stale.status_code == 200 and stale.json()["stale"] is True
    assert stale.json()["messages"] == fresh.json()["messages"]
    assert stale.json()["syncTime"] == fresh.json()["syncTime"]
    assert trace.json()["stale"] is True and trace.json()["syncTime"]
    assert stale.json()["ageS"] >= 0 and trace.json()["ageS"] >= stale.json()["ageS"]
    assert refused.status_code == 503, refused.text
    assert "nothing was appended" in refused.json()["error"]["message"]
    assert never_read.status_code == 503 and "no cached copy" in never_read.json()["error"]["message"]
    assert again.json()["stale"] is False
    assert "while down" not in [m["content"] for m in again.json()["messages"]]


async def test_a_peer_dying_mid_read(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 30)
    ref = f"@orgbp/{tid}"
    async with fed.cloud.http() as http:
        await http.get(f"/api/traces/{ref}/messages")
        late = [f"x{i}-" + secrets.token_hex(200) for i in range(50)]
        await append(fed.orgb, tid, late)
        fed.proxy.bytes_back = 0
        fed.proxy.cut_after = 3000  # what the peer sends from now on is cut after 3 kB
        try:
            cut = await http.get(f"/api/traces/{ref}/messages", params={"mode": "all", "limit": 1000})
        finally:
            fed.proxy.cut_after = None
        whole = await http.get(f"/api/traces/{ref}/messages", params={"mode": "all", "limit": 1000})
    assert cut.status_code == 200 and cut.json()["stale"] is True
    assert not any(m["content"].startswith("x0") for m in cut.json()["messages"])
    assert whole.json()["stale"] is False
    assert [m["content"] for m in whole.json()["messages"]][-50:] == late


async def test_deleting_the_owners_data_deletes_the_cached_copies(fed: Fed) -> None:
    carol = await fed.cloud.new_user("carol-fed")
    tid = await new_trace(fed.orgb, 2)
    async with fed.cloud.http(carol) as http:
        assert (await http.get(f"/api/traces/@orgb/{tid}")).status_code == 200
        dave = await fed.cloud.new_user("dave-fed")
        async with fed.cloud.http(dave) as other:
            # dave reads the same peer trace through his own copy; carol's copy is not his
            assert (await other.get(f"/api/traces/@orgb/{tid}")).status_code == 200
        assert (await http.delete("/api/sessions")).status_code == 200
    assert fed.cloud.clients is not None
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from agentmesh.libs import identity
    from agentmesh.services.trace.store.sql.common import Database  # noqa: F401  (the copy is a row of traces)

    engine = create_async_engine(
        fed.cloud.settings.model_copy(update={"database_url": _pg(fed)}).sqlalchemy_url
    )
    try:
        async with engine.connect() as conn:
            rows = (
                await conn.execute(
                    sa.text("SELECT u.name FROM traces s JOIN users u ON u.id = s.user_id WHERE s.home = :h"),
                    {"h": f"@orgb/{tid}"},
                )
            ).all()
    finally:
        await engine.dispose()
    assert [r[0] for r in rows] == ["dave-fed"]
    del identity


def _pg(fed: Fed) -> str:
    import yaml

    return str(yaml.safe_load(fed.peers_a.read_text())["trace_store"]["internal"]["url"])


async def test_peer_calls_and_cache_reads_are_counted(fed: Fed) -> None:
    """The trace service's /metrics: requests to each peer by outcome; reads of peers' traces, fresh or
    stale."""
    from prometheus_client import generate_latest

    tid = await new_trace(fed.orgb, 1)
    async with fed.cloud.http() as http:
        await http.get(f"/api/traces/@orgbp/{tid}/messages")
        await fed.proxy.down()
        try:
            await http.get(f"/api/traces/@orgbp/{tid}/messages")
        finally:
            await fed.proxy.up()
    text = generate_latest(fed.cloud.servers["trace"].registry).decode()
    assert 'agentmesh_peer_requests_total{method="GET",outcome="ok",peer="orgbp"}' in text
    assert 'agentmesh_peer_requests_total{method="GET",outcome="unavailable",peer="orgbp"}' in text
    assert 'agentmesh_peer_trace_reads_total{peer="orgbp",source="stale"}' in text
    assert 'agentmesh_peer_trace_reads_total{peer="orgbp",source="fresh"}' in text


async def test_a_cached_copy_takes_no_turn_by_its_local_id(fed: Fed) -> None:
    """A turn on our copy would fork the peer's trace: refused, whichever way its local id is named."""
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    tid = await new_trace(fed.orgb, 1)
    async with fed.cloud.http() as http:
        assert (await http.get(f"/api/traces/@orgb/{tid}")).status_code == 200
        engine = create_async_engine(_pg(fed).replace("postgresql://", "postgresql+asyncpg://"))
        try:
            async with engine.connect() as conn:
                copy_id = (
                    await conn.execute(
                        sa.text("SELECT id FROM traces WHERE home = :h"), {"h": f"@orgb/{tid}"}
                    )
                ).scalar_one()
        finally:
            await engine.dispose()
        chat = await http.post("/api/chat", json={"agent": "coder", "message": "fork?", "sessionId": copy_id})
        run = await http.post(f"/api/traces/{copy_id}/run", json={"input": "fork?"})
    for resp in (chat, run):
        assert resp.status_code == 422, resp.text
        assert "lives on a peer" in resp.json()["error"]["message"]


async def test_an_append_whose_answer_is_lost_says_it_may_have_arrived(fed: Fed) -> None:
    tid = await new_trace(fed.orgb, 1)
    ref = f"@orgbp/{tid}"
    async with fed.cloud.http() as http:
        assert (await http.get(f"/api/traces/{ref}")).status_code == 200
        fed.proxy.bytes_back = 0
        fed.proxy.cut_after = 10  # the peer's answer is cut: the request itself went through
        try:
            resp = await http.post(
                f"/api/traces/{ref}/messages", json={"messages": [{"role": "user", "content": "did it?"}]}
            )
        finally:
            fed.proxy.cut_after = None
    assert resp.status_code == 503, resp.text
    assert "may or may not have arrived" in resp.json()["error"]["message"]
    async with fed.orgb.http() as http:
        home = (await http.get(f"/api/traces/{tid}/messages")).json()["messages"]
    assert home[-1]["content"] == "did it?"  # it had: the answer says so honestly, never "nothing"
