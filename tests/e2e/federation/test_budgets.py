"""Every read has a budget shorter than its caller's (docs/federation.md#budgets): a "reader" mesh with
the default federation settings except a short gateway deadline (3 s, so that a test meets it in
seconds) reads org B through a relay that can hang (accept and hold every request), answer slowly, or
cut its answers. A read of a cached trace answers from the copy within 1 s, whatever the peer does; a
peer that timed out is marked down like one that refused, reads then answer at once with no dial, and
one background probe finds the peer back; an append whose outcome is unknown answers 503 "not
confirmed" before the gateway's deadline."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.e2e.federation.conftest import RULES, Fed, Proxy
from tests.e2e.federation.test_reads import append, new_trace
from tests.mesh import Mesh, Ports, start_mesh, wait_until

GATEWAY_DEADLINE_S = 3.0


@dataclass
class Reader:
    mesh: Mesh
    relay: Proxy  # org B behind it, registered as `slow`

    def metric(self, name: str, **labels: str) -> float:
        value = self.mesh.servers["trace"].registry.get_sample_value(name, labels)
        return value or 0.0

    def gets(self, outcome: str = "ok") -> float:
        labels = {"peer": "slow", "method": "GET", "outcome": outcome}
        return self.metric("agentmesh_peer_requests_total", **labels)

    def is_down(self) -> bool:
        registry = self.mesh.servers["trace"].registry
        return registry.get_sample_value("agentmesh_peer_up", {"peer": "slow"}) == 0.0


@pytest.fixture(scope="module")
async def reader(fed: Fed, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Reader]:
    tmp = tmp_path_factory.mktemp("reader")
    ports = Ports()
    relay = Proxy(ports.take(), int(fed.orgb.url.rsplit(":", 1)[1]))
    env = f"FEDTEST_{uuid.uuid4().hex[:8].upper()}_SLOW_KEY"
    peers = tmp / "peers.yaml"
    spec = {"url": f"http://127.0.0.1:{relay.port}", "credential": env, "type": "org"}
    peers.write_text(yaml.safe_dump({"peers": {"slow": spec}}))
    os.environ[env] = fed.orgb.api_key
    mesh = None
    try:
        await relay.up()
        mesh = await start_mesh(
            tmp,
            rules=RULES,
            peers=str(peers),
            rpc_timeout_s=GATEWAY_DEADLINE_S,
            # the defaults (timeout 10 s, 2 retries, 0.8 s wait for a cached read), a quick probe
            federation={"down_s": 0.3, "probe_max_s": 0.6},
        )
        yield Reader(mesh, relay)
    finally:
        relay.release()
        await relay.down()
        if mesh is not None:
            await mesh.stop()
        os.environ.pop(env, None)
        ports.release()


async def timed(http: Any, method: str, path: str, **kwargs: Any) -> tuple[Any, float]:
    started = time.monotonic()
    resp = await http.request(method, path, **kwargs)
    return resp, time.monotonic() - started


async def back_up(reader: Reader, http: Any, ref: str) -> None:
    """The relay answers again: the probe finds the peer back, and a read is fresh."""
    reader.relay.release()
    reader.relay.delay_s, reader.relay.cut_after = 0.0, None

    async def fresh() -> bool:
        resp = await http.get(f"/api/traces/{ref}/messages")
        return bool(resp.status_code == 200 and resp.json()["stale"] is False)

    await wait_until(fresh, timeout=15, what="the probe to find the peer back")


async def test_a_hung_peer_a_cached_read_answers_stale_within_a_second(fed: Fed, reader: Reader) -> None:
    tid = await new_trace(fed.orgb, 3)
    ref = f"@slow/{tid}"
    async with reader.mesh.http() as http:
        fresh = await http.get(f"/api/traces/{ref}/messages")
        assert fresh.status_code == 200 and fresh.json()["stale"] is False
        reader.relay.hold()
        try:
            page, page_s = await timed(http, "GET", f"/api/traces/{ref}/messages")
            trace, trace_s = await timed(http, "GET", f"/api/traces/{ref}")
            assert page.status_code == 200 and trace.status_code == 200, (page.text, trace.text)
            assert page_s < 1.0 and trace_s < 1.0, (page_s, trace_s)
            assert page.json()["stale"] is True and trace.json()["stale"] is True
            assert page.json()["syncTime"] == fresh.json()["syncTime"] and page.json()["ageS"] >= 0
            assert page.json()["messages"] == fresh.json()["messages"]
            # the sync that hung is cut at the caller's deadline minus the margin: the peer is down
            await wait_until(reader.is_down, timeout=GATEWAY_DEADLINE_S + 2, what="the peer marked down")
            dials = reader.gets("ok") + reader.gets("deadline_exceeded") + reader.gets("cancelled")
            for _ in range(5):  # while down: at once from the copy, no dial per read
                again, again_s = await timed(http, "GET", f"/api/traces/{ref}/messages")
                assert again.json()["stale"] is True and again_s < 0.3, again_s
            assert reader.gets("ok") + reader.gets("deadline_exceeded") + reader.gets("cancelled") == dials
            refused = await http.post(
                f"/api/traces/{ref}/messages", json={"messages": [{"role": "user", "content": "while down"}]}
            )
            assert refused.status_code == 503 and "nothing was appended" in refused.json()["error"]["message"]
        finally:
            await back_up(reader, http, ref)
    assert reader.metric("agentmesh_peer_up", peer="slow") == 1.0


async def test_a_hung_peer_an_uncached_read_and_an_append_end_before_the_gateway(
    fed: Fed, reader: Reader
) -> None:
    """No copy to fall back on: 503 with the reason, before the gateway's own deadline (never a bare
    504); an append whose answer never came: 503 "not confirmed"."""
    tid = await new_trace(fed.orgb, 1)
    cached = f"@slow/{tid}"
    async with reader.mesh.http() as http:
        assert (await http.get(f"/api/traces/{cached}")).status_code == 200
        reader.relay.hold()
        try:
            resp, took = await timed(
                http, "POST", f"/api/traces/{cached}/messages",
                json={"messages": [{"role": "user", "content": "into the void"}]},
            )  # fmt: skip
            assert resp.status_code == 503, resp.text
            assert "not confirmed" in resp.json()["error"]["message"]
            assert took < GATEWAY_DEADLINE_S, took
        finally:
            await back_up(reader, http, cached)
        new = await new_trace(fed.orgb, 1)
        reader.relay.hold()
        try:
            resp, took = await timed(http, "GET", f"/api/traces/@slow/{new}")
            assert resp.status_code == 503, resp.text
            assert "no cached copy" in resp.json()["error"]["message"]
            assert took < GATEWAY_DEADLINE_S, took
        finally:
            await back_up(reader, http, cached)


async def test_a_slow_peer_reads_stay_quick_and_the_copy_catches_up(fed: Fed, reader: Reader) -> None:
    tid = await new_trace(fed.orgb, 1)
    ref = f"@slow/{tid}"
    async with reader.mesh.http() as http:
        assert (await http.get(f"/api/traces/{ref}/messages")).json()["stale"] is False
        await append(fed.orgb, tid, ["while slow"])
        timeouts = reader.gets("deadline_exceeded")
        reader.relay.delay_s = 0.9  # each request reaches the peer 0.9 s late: a sync takes ~2 s
        try:
            page, took = await timed(http, "GET", f"/api/traces/{ref}/messages")
            assert page.status_code == 200 and took < 1.0, took
            assert page.json()["stale"] is True

            async def caught_up() -> bool:  # the sync went on in the background
                resp = await http.get(f"/api/traces/{ref}/messages")
                return "while slow" in [m["content"] for m in resp.json()["messages"]]

            await wait_until(caught_up, timeout=10, what="the copy to catch up")
            assert reader.gets("deadline_exceeded") == timeouts  # slow is not down
            assert reader.metric("agentmesh_peer_up", peer="slow") != 0.0
        finally:
            await back_up(reader, http, ref)


async def test_a_peer_that_drops_mid_response(fed: Fed, reader: Reader) -> None:
    tid = await new_trace(fed.orgb, 2)
    ref = f"@slow/{tid}"
    async with reader.mesh.http() as http:
        fresh = await http.get(f"/api/traces/{ref}/messages")
        await append(fed.orgb, tid, ["x" * 5000 for _ in range(5)])
        reader.relay.bytes_back = 0
        reader.relay.cut_after = 200  # every answer from now on is cut after 200 bytes
        try:
            page, took = await timed(http, "GET", f"/api/traces/{ref}/messages")
            assert page.status_code == 200 and took < 1.0, took
            assert page.json()["stale"] is True
            assert page.json()["messages"] == fresh.json()["messages"]
            await wait_until(reader.is_down, timeout=GATEWAY_DEADLINE_S + 2, what="the peer marked down")
        finally:
            await back_up(reader, http, ref)
