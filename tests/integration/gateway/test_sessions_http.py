"""The gateway's session routes (gateway/routes/sessions.py) over the real app (httpx ASGITransport), a
real trace service per backend (the fixtures of tests/integration/trace/conftest.py) and the stream and
orchestrator services that deletes go through."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.gateway.app import create_app
from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.identity import Signer
from agentmesh.libs.protojson import to_json
from agentmesh.libs.rpc import ServiceServer
from agentmesh.services.orchestrator import server as orchestrator_server
from agentmesh.services.stream import server as stream_server
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace import conftest as trace_fixtures
from tests.integration.trace.conftest import TraceBackend, append, new_trace
from tests.mesh import ANY_PORT

# A real trace process per backend, as tests/integration/trace has it.
trace_pg_url = trace_fixtures.trace_pg_url
trace_backend = trace_fixtures.trace_backend
trace_server = trace_fixtures.trace_server
trace_channel = trace_fixtures.trace_channel
trace_stub = trace_fixtures.trace_stub
message_stub = trace_fixtures.message_stub
auth_stub = trace_fixtures.auth_stub


@pytest.fixture(scope="session")
async def gateway_http(
    trace_backend: TraceBackend, trace_server: ServiceServer, signer: Signer
) -> AsyncIterator[httpx.AsyncClient]:
    """The real gateway app (no auth header set) over httpx.ASGITransport, with real trace, stream and
    orchestrator services behind it."""
    settings = trace_backend.settings
    settings.addresses.trace = trace_server.target
    stream = await (await stream_server.build(settings, ANY_PORT, signer=signer)).start()
    settings.addresses.stream = stream.target
    orchestrator = await orchestrator_server.build(settings, ANY_PORT, signer)
    settings.addresses.orchestrator = orchestrator.target
    clients = Clients(settings, signer)
    app = create_app(settings, clients)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client
    await clients.close()
    await orchestrator.stop(0)
    await stream.stop(0)


async def _auth(stub, user):
    key = (await stub.CreateApiKey(au.CreateApiKeyRequest(user=user))).api_key
    return {"Authorization": f"Bearer {key}"}


async def _trace(stub, owner, trace_id):
    with identity.acting_as(owner):
        return (await stub.GetTrace(ts.GetTraceRequest(trace_id=trace_id))).trace


def _error(status, reason, message):
    return {"error": {"code": status, "reason": reason, "message": message}}


NOT_FOUND = _error(404, "NOT_FOUND", "trace not found")


async def test_session_routes(gateway_http, trace_stub, auth_stub, unique, message_stub):
    owner = f"u-{unique}"
    h = await _auth(auth_stub, owner)
    first = await new_trace(trace_stub, owner, title="first")
    second = await new_trace(trace_stub, owner, title="second")
    await new_trace(trace_stub, owner, kind=tp.TRACE_KIND_A2A)  # hidden
    m1 = await append(message_stub, owner, second.id, "q")
    m2 = await append(message_stub, owner, second.id, "a", tp.MESSAGE_ROLE_ASSISTANT)
    m3 = await append(message_stub, owner, second.id, "a'", tp.MESSAGE_ROLE_ASSISTANT, parent=m1.sequence)
    first_json = to_json(await _trace(trace_stub, owner, first.id))
    second_json = to_json(await _trace(trace_stub, owner, second.id))
    assert (second_json["kind"], second_json["headSequence"], second_json["owner"]) == ("chat", 3, owner)
    assert second_json["createTime"].endswith("Z")

    listed = await gateway_http.get("/api/sessions", headers=h)
    assert listed.status_code == 200
    assert listed.json() == {"sessions": [second_json, first_json], "nextPageToken": ""}
    page = await gateway_http.get("/api/sessions", params={"page_size": 1}, headers=h)
    assert page.status_code == 200 and page.json()["sessions"] == [second_json]
    token = page.json()["nextPageToken"]
    assert token
    rest = await gateway_http.get("/api/sessions", params={"page_size": 1, "page_token": token}, headers=h)
    assert rest.status_code == 200 and rest.json() == {"sessions": [first_json], "nextPageToken": ""}

    one = await gateway_http.get(f"/api/sessions/{second.id}", headers=h)
    assert one.status_code == 200
    assert one.json() == {"session": second_json, "messageCount": 3, "mainPathCount": 2}

    main = await gateway_http.get(f"/api/sessions/{second.id}/messages", headers=h)
    assert main.status_code == 200
    assert main.json() == {"messages": [to_json(m1), to_json(m3)], "headSequence": 3, "total": 2}
    assert (
        main.json()["messages"][1]["role"] == "assistant"
        and main.json()["messages"][1]["parentSequence"] == 1
    )
    everything = await gateway_http.get(
        f"/api/sessions/{second.id}/messages",
        params={"mode": "all", "since_sequence": 1, "limit": 1},
        headers=h,
    )
    assert everything.status_code == 200
    assert everything.json() == {"messages": [to_json(m2)], "headSequence": 3, "total": 2}
    branch = await gateway_http.get(
        f"/api/sessions/{second.id}/messages", params={"head_sequence": 2}, headers=h
    )
    assert branch.status_code == 200
    assert branch.json() == {"messages": [to_json(m1), to_json(m2)], "headSequence": 2, "total": 2}

    for params, why in (
        ({"mode": "sideways"}, "query.mode: Input should be 'main_path' or 'all'"),
        ({"limit": -1}, "query.limit: Input should be greater than or equal to 0"),
        ({"limit": 5000}, "query.limit: Input should be less than or equal to 1000"),
        ({"offset": -3}, "query.offset: Input should be greater than or equal to 0"),
    ):
        bad = await gateway_http.get(f"/api/sessions/{second.id}/messages", params=params, headers=h)
        assert bad.status_code == 422, params
        error = bad.json()["error"]
        assert (error["code"], error["reason"], error["message"]) == (
            422,
            "INVALID_ARGUMENT",
            f"invalid request: {why}",
        )
        assert [d["loc"][-1] for d in error["details"]] == list(params), params
    unknown_head = await gateway_http.get(
        f"/api/sessions/{second.id}/messages", params={"head_sequence": 99}, headers=h
    )
    assert unknown_head.status_code == 422
    assert unknown_head.json() == _error(422, "INVALID_ARGUMENT", "head_sequence 99 is not in the trace")
    bad_token = await gateway_http.get("/api/sessions", params={"page_token": "garbage"}, headers=h)
    assert bad_token.status_code == 422
    assert bad_token.json() == _error(422, "INVALID_ARGUMENT", "invalid page_token")
    not_base64 = await gateway_http.get("/api/sessions", params={"page_token": "garbage!"}, headers=h)
    assert not_base64.status_code == 422
    assert not_base64.json()["error"]["message"].startswith(
        "invalid request: query.page_token: String should match pattern"
    )

    renamed = await gateway_http.patch(f"/api/sessions/{first.id}", json={"title": "renamed"}, headers=h)
    assert renamed.status_code == 200
    first_json = to_json(await _trace(trace_stub, owner, first.id))
    assert first_json["title"] == "renamed" and renamed.json() == {"session": first_json}
    for body in ({"title": ""}, {"title": "x" * 501}, {"title": "x", "kind": "a2a"}, {}):
        bad = await gateway_http.patch(f"/api/sessions/{first.id}", json=body, headers=h)
        assert bad.status_code == 422, body
        assert bad.json()["error"]["reason"] == "INVALID_ARGUMENT", body
    assert (await _trace(trace_stub, owner, first.id)).title == "renamed"

    deleted = await gateway_http.delete(f"/api/sessions/{first.id}", headers=h)
    assert deleted.status_code == 200 and deleted.json() == {"deleted": True}
    gone = await gateway_http.get(f"/api/sessions/{first.id}", headers=h)
    assert gone.status_code == 404 and gone.json() == NOT_FOUND
    again = await gateway_http.delete(f"/api/sessions/{first.id}", headers=h)
    assert again.status_code == 404 and again.json() == NOT_FOUND
    # Every trace of the user goes, hidden ones too: the chat and the hidden a2a trace.
    all_gone = await gateway_http.delete("/api/sessions", headers=h)
    assert all_gone.status_code == 200 and all_gone.json() == {"deletedCount": 2}
    empty = await gateway_http.get("/api/sessions", headers=h)
    assert empty.status_code == 200 and empty.json() == {"sessions": [], "nextPageToken": ""}


async def test_routes_need_auth_and_hide_other_owners(
    gateway_http, trace_stub, auth_stub, unique, message_stub
):
    a, b = f"a-{unique}", f"b-{unique}"
    ha, hb = await _auth(auth_stub, a), await _auth(auth_stub, b)
    trace = await new_trace(trace_stub, a, title="private")
    await append(message_stub, a, trace.id, "secret")

    for headers, message in (
        ({}, "missing bearer token: send Authorization: Bearer KEY"),
        ({"Authorization": "Basic x"}, "missing bearer token: send Authorization: Bearer KEY"),
        ({"Authorization": "Bearer "}, "missing or malformed bearer token: send Authorization: Bearer KEY"),
        ({"Authorization": "Bearer am_nope"}, "invalid API key"),
    ):
        for method, path in (
            ("GET", "/api/sessions"),
            ("GET", f"/api/sessions/{trace.id}"),
            ("GET", f"/api/sessions/{trace.id}/messages"),
            ("DELETE", f"/api/sessions/{trace.id}"),
            ("DELETE", "/api/sessions"),
        ):
            denied = await gateway_http.request(method, path, headers=headers)
            assert denied.status_code == 401, (headers, path)
            assert denied.json() == _error(401, "UNAUTHENTICATED", message), (headers, path)

    empty = await gateway_http.get("/api/sessions", headers=hb)
    assert empty.status_code == 200 and empty.json() == {"sessions": [], "nextPageToken": ""}
    for method, path, body in (
        ("GET", "/api/sessions/{}", None),
        ("GET", "/api/sessions/{}/messages", None),
        ("PATCH", "/api/sessions/{}", {"title": "mine now"}),
        ("DELETE", "/api/sessions/{}", None),
    ):
        probe = await gateway_http.request(method, path.format(trace.id), headers=hb, json=body)
        missing = await gateway_http.request(method, path.format("no-such-session"), headers=hb, json=body)
        assert probe.status_code == missing.status_code == 404, path
        assert probe.json() == missing.json() == NOT_FOUND, path
    none = await gateway_http.delete("/api/sessions", headers=hb)
    assert none.status_code == 200 and none.json() == {"deletedCount": 0}
    still = await gateway_http.get(f"/api/sessions/{trace.id}", headers=ha)
    assert still.status_code == 200
    body = still.json()
    assert (body["session"]["title"], body["messageCount"], body["mainPathCount"]) == ("private", 1, 1)


async def test_a_burst_of_requests_with_one_key_checks_it_once(gateway_http, trace_server, auth_stub, unique):
    """The gateway's key cache misses for a burst of requests at once (a new key, or its entry just
    expired): they share one AuthService call; a refused key is refused to each of them."""
    import asyncio

    def checks() -> float:
        labels = {
            "grpc_service": "agentmesh.auth.v1.AuthService",
            "grpc_method": "AuthenticateApiKey",
            "grpc_type": "unary",
        }
        return trace_server.registry.get_sample_value("agentmesh_grpc_server_started_total", labels) or 0.0

    headers = await _auth(auth_stub, f"burst-{unique}")
    before = checks()
    answers = await asyncio.gather(*(gateway_http.get("/api/sessions", headers=headers) for _ in range(20)))
    assert [r.status_code for r in answers] == [200] * 20
    assert checks() - before == 1
    refused = await asyncio.gather(
        *(gateway_http.get("/api/sessions", headers={"Authorization": "Bearer am_wrong"}) for _ in range(5))
    )
    assert [r.status_code for r in refused] == [401] * 5


async def test_a_key_check_its_requests_left_ends_without_an_unretrieved_error(gateway_http, unique):
    """The one AuthService call of a burst outlives requests that leave meanwhile; when every one of
    them left before a refusal came, the refusal is nobody's to read, and asyncio must not report it as
    a task exception that was never retrieved."""
    import asyncio
    import gc

    from agentmesh.gateway import deps

    app = gateway_http._transport.app  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        key = f"am_gone-{unique}"
        request = asyncio.ensure_future(deps.authenticate(app.state, f"Bearer {key}"))
        for _ in range(100):  # a few passes of the loop: its first step starts the check
            if key in app.state.auth_pending:
                break
            await asyncio.sleep(0)
        asking = app.state.auth_pending[key]
        request.cancel()  # its only request leaves
        with pytest.raises(asyncio.CancelledError):
            await request
        await asyncio.wait({asking}, timeout=10)
        assert asking.done()  # (refused: reading its exception here would be the retrieval itself)
        del asking
        gc.collect()
        assert not [c for c in reported if "never retrieved" in str(c.get("message"))]
    finally:
        loop.set_exception_handler(previous)
