"""No server-side request forgery: a trace id that names anything but a registered peer is refused with
a clear error and makes no outbound connection (a canary listener counts them); a registered peer that
answers with a redirect is not followed."""

from __future__ import annotations

import pytest

from tests.e2e.federation.conftest import Fed


@pytest.mark.parametrize(
    ("make_id", "status", "words"),
    [
        (lambda f: f"agent://127.0.0.1:{f.canary.port}/x", 403, "not a registered peer"),
        (lambda f: "agent://127.0.0.1:22/x", 403, "not a registered peer"),
        (lambda f: "agent://169.254.169.254/x", 403, "not a registered peer"),
        (lambda f: "agent://[::1]:22/x", 403, "not a registered peer"),
        (lambda f: "agent://metadata.google.internal/x", 403, "not a registered peer"),
        # the IP literal of a registered peer's name (`named` is http://localhost:<canary>): names are
        # never resolved to match an address, so only the spelling in the registry is a peer
        (lambda f: f"agent://127.0.0.1:{f.canary.port}/x", 403, "not a registered peer"),
        (lambda f: f"agent://user@localhost:{f.canary.port}/x", 422, "user information"),
        (lambda f: f"agent://u:p@127.0.0.1:{f.canary.port}/x", 422, "user information"),
        (lambda f: "@unknown-peer/x", 403, "unknown peer"),
        (lambda f: "@../x", 422, "@alias"),
        (lambda f: "@named%2F..%2F/x", 422, ""),
        (lambda f: "@named/../x", 422, ""),
        (lambda f: f"agent://localhost:{f.canary.port}/x/../../y", 422, ""),
    ],
)
async def test_unregistered_hosts_are_refused_with_no_connection(
    fed: Fed, make_id: object, status: int, words: str
) -> None:
    trace_id = make_id(fed)  # type: ignore[operator]
    before = fed.canary.connections
    async with fed.cloud.http() as http:
        for path in (f"/api/traces/{trace_id}", f"/api/traces/{trace_id}/messages"):
            resp = await http.get(path)
            assert resp.status_code in (status, 404), (trace_id, resp.status_code, resp.text)
            if resp.status_code != 404:  # a path the router cannot take apart is an unknown path
                assert words in resp.json()["error"]["message"], resp.text
        appended = await http.post(
            f"/api/traces/{trace_id}/messages", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert appended.status_code in (status, 404, 405), appended.text
    assert fed.canary.connections == before, f"{trace_id} made an outbound connection"


async def test_a_redirect_from_a_registered_peer_is_not_followed(fed: Fed) -> None:
    before_canary, before_redir = fed.canary.connections, fed.redirector.connections
    async with fed.cloud.http() as http:
        resp = await http.get("/api/traces/@redir/abc")
    assert resp.status_code == 503, resp.text
    assert "redirect" in resp.json()["error"]["message"]
    assert fed.redirector.connections == before_redir + 1, "a redirect is not retried either"
    assert fed.canary.connections == before_canary


async def test_agent_invoke_of_an_unregistered_trace_makes_no_connection(fed: Fed) -> None:
    from tests.mesh import chat

    before = fed.canary.connections
    events = await chat(
        fed.cloud, "general", f"remote-continue coder agent://127.0.0.1:{fed.canary.port}/x go"
    )
    outputs = [e for e in events if e["type"] == "tool-output-available"]
    assert outputs and outputs[0]["ok"] is False
    assert "not a registered peer" in str(outputs[0]["output"])
    assert fed.canary.connections == before
