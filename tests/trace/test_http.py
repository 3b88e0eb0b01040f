"""The gateway session routes over the real app (httpx ASGITransport) and the real trace service."""

from __future__ import annotations

from agentmesh.v1 import trace_pb2
from agentmesh.v1 import trace_service_pb2 as ts
from tests.trace.conftest import append, new_session


async def _key(stub, user):
    return (await stub.CreateApiKey(ts.CreateApiKeyRequest(user=user))).api_key


def _auth(key):
    return {"Authorization": f"Bearer {key}"}


async def test_session_routes(gateway_http, trace_stub, unique):
    owner = f"u-{unique}"
    h = _auth(await _key(trace_stub, owner))
    first = await new_session(trace_stub, owner, title="first")
    second = await new_session(trace_stub, owner, title="second")
    await new_session(trace_stub, owner, kind=trace_pb2.SESSION_KIND_A2A)  # hidden
    m1 = await append(trace_stub, owner, second.id, "q")
    await append(trace_stub, owner, second.id, "a", trace_pb2.MESSAGE_ROLE_ASSISTANT)
    await append(trace_stub, owner, second.id, "a'", trace_pb2.MESSAGE_ROLE_ASSISTANT, parent=m1.sequence)

    listed = await gateway_http.get("/api/sessions", headers=h)
    assert listed.status_code == 200
    body = listed.json()
    assert [s["id"] for s in body["sessions"]] == [second.id, first.id] and body["nextPageToken"] == ""
    assert body["sessions"][0]["kind"] == "chat" and body["sessions"][0]["headSequence"] == 3
    assert body["sessions"][0]["owner"] == owner and "createTime" in body["sessions"][0]
    page = (await gateway_http.get("/api/sessions", params={"page_size": 1}, headers=h)).json()
    assert [s["id"] for s in page["sessions"]] == [second.id] and page["nextPageToken"]
    rest = await gateway_http.get(
        "/api/sessions", params={"page_size": 1, "page_token": page["nextPageToken"]}, headers=h
    )
    assert [s["id"] for s in rest.json()["sessions"]] == [first.id]

    one = (await gateway_http.get(f"/api/sessions/{second.id}", headers=h)).json()
    assert (one["session"]["title"], one["messageCount"], one["mainPathCount"]) == ("second", 3, 2)

    main = (await gateway_http.get(f"/api/sessions/{second.id}/messages", headers=h)).json()
    assert [m["content"] for m in main["messages"]] == ["q", "a'"]
    assert (main["headSequence"], main["total"]) == (3, 2)
    assert main["messages"][1]["role"] == "assistant" and main["messages"][1]["parentSequence"] == 1
    everything = await gateway_http.get(
        f"/api/sessions/{second.id}/messages",
        params={"mode": "all", "since_sequence": 1, "limit": 1},
        headers=h,
    )
    assert [m["sequence"] for m in everything.json()["messages"]] == [2] and everything.json()["total"] == 2
    branch = await gateway_http.get(
        f"/api/sessions/{second.id}/messages", params={"head_sequence": 2}, headers=h
    )
    assert [m["content"] for m in branch.json()["messages"]] == ["q", "a"]

    for params in (
        {"mode": "sideways"},
        {"limit": -1},
        {"limit": 5000},
        {"offset": -3},
        {"head_sequence": 99},
    ):
        bad = await gateway_http.get(f"/api/sessions/{second.id}/messages", params=params, headers=h)
        assert bad.status_code == 422, params
        assert bad.json()["error"]["reason"] == "INVALID_ARGUMENT"
    bad_token = await gateway_http.get("/api/sessions", params={"page_token": "garbage!"}, headers=h)
    assert bad_token.status_code == 422

    deleted = await gateway_http.delete(f"/api/sessions/{first.id}", headers=h)
    assert deleted.status_code == 200 and deleted.json() == {"deleted": True}
    assert (await gateway_http.get(f"/api/sessions/{first.id}", headers=h)).status_code == 404
    all_gone = await gateway_http.delete("/api/sessions", headers=h)
    assert all_gone.json() == {"deletedCount": 2}
    assert (await gateway_http.get("/api/sessions", headers=h)).json()["sessions"] == []


async def test_routes_need_auth_and_hide_other_owners(gateway_http, trace_stub, unique):
    a, b = f"a-{unique}", f"b-{unique}"
    ha, hb = _auth(await _key(trace_stub, a)), _auth(await _key(trace_stub, b))
    session = await new_session(trace_stub, a, title="private")
    await append(trace_stub, a, session.id, "secret")

    for headers in ({}, {"Authorization": "Bearer am_nope"}, {"Authorization": "Basic x"}):
        denied = await gateway_http.get("/api/sessions", headers=headers)
        assert denied.status_code == 401 and denied.json()["error"]["reason"] == "UNAUTHENTICATED"

    assert (await gateway_http.get("/api/sessions", headers=hb)).json()["sessions"] == []
    for method, path in (
        ("GET", "/api/sessions/{}"),
        ("GET", "/api/sessions/{}/messages"),
        ("DELETE", "/api/sessions/{}"),
    ):
        probe = await gateway_http.request(method, path.format(session.id), headers=hb)
        missing = await gateway_http.request(method, path.format("no-such-session"), headers=hb)
        assert probe.status_code == missing.status_code == 404, path
        assert probe.json() == missing.json(), path
    assert (await gateway_http.delete("/api/sessions", headers=hb)).json() == {"deletedCount": 0}
    still = await gateway_http.get(f"/api/sessions/{session.id}", headers=ha)
    assert still.status_code == 200 and still.json()["messageCount"] == 1
