"""The gateway's agent routes (gateway/routes/agents.py) over the real app (httpx ASGITransport) and a
real trace process per backend: create, read, a merge-patch change at a version (ETag / If-Match, 412
when stale), delete, clone, options; built-ins read-only; another user's agent a 404 like a missing
one; validation errors as 422 naming the field."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.gateway.app import create_app
from agentmesh.libs import tools
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import SubagentDefaults
from agentmesh.libs.protojson import to_json
from agentmesh.services.trace import agents as rules
from tests.integration.trace import conftest as trace_fixtures
from tests.integration.trace.conftest import TraceBackend

# A real trace process per backend, as tests/integration/trace has it.
trace_pg_url = trace_fixtures.trace_pg_url
trace_backend = trace_fixtures.trace_backend
trace_server = trace_fixtures.trace_server
trace_channel = trace_fixtures.trace_channel
auth_stub = trace_fixtures.auth_stub
trace_clients = trace_fixtures.trace_clients


@pytest.fixture(scope="session")
async def gateway_http(
    trace_backend: TraceBackend, trace_clients: Clients
) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(trace_backend.settings, trace_clients)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
        yield client


async def _auth(stub: Any, user: str) -> dict[str, str]:
    key = (await stub.CreateApiKey(au.CreateApiKeyRequest(user=user))).api_key
    return {"Authorization": f"Bearer {key}"}


def to_dict(message: Any) -> dict[str, Any]:
    return dict(to_json(message))


def tools_blocked() -> list[str]:
    return SubagentDefaults().blocked_tool_names


def _error(status: int, reason: str, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "reason": reason, "message": message}}


REVIEWER = {
    "slug": "reviewer",
    "name": "Reviewer",
    "systemPrompt": "Review the code you are given.",
    "tools": ["agent-invoke"],
    "invoke": {"allowedCallees": ["coder"], "maxRecursionDepth": 1},
}


async def test_create_read_change_and_delete(gateway_http, auth_stub, unique):
    h = await _auth(auth_stub, f"u-{unique}")
    created = await gateway_http.post("/api/agents", json=REVIEWER, headers=h)
    assert created.status_code == 201, created.text
    assert created.headers["etag"] == '"1"'
    agent = created.json()["agent"]
    assert (agent["slug"], agent["owner"], agent["version"]) == ("reviewer", f"u-{unique}", 1)
    # What the body did not give has its defaults; what it gave is kept (a 1 as much as a 0 would be).
    assert agent["invoke"] == {
        **to_dict(rules.DEFAULT_INVOKE),
        "allowedCallees": ["coder"],
        "maxRecursionDepth": 1,
    }
    assert agent["limits"] == to_dict(rules.DEFAULT_LIMITS)
    assert agent["effectiveSubagentConfig"]["blockedToolNames"] == tools_blocked()

    listed = (await gateway_http.get("/api/agents", headers=h)).json()["agents"]
    assert [a["slug"] for a in listed] == ["coder", "general", "researcher", "reviewer"]
    assert listed[3] == agent
    one = await gateway_http.get("/api/agents/reviewer", headers=h)
    assert (one.status_code, one.headers["etag"], one.json()) == (200, '"1"', {"agent": agent})

    # A merge patch at the version read: the keys given change, nested objects key by key.
    patch = {"systemPrompt": "Review strictly.", "limits": {"maxSteps": 4}}
    changed = await gateway_http.patch("/api/agents/reviewer", json=patch, headers={**h, "If-Match": '"1"'})
    assert changed.status_code == 200, changed.text
    assert changed.headers["etag"] == '"2"'
    new = changed.json()["agent"]
    assert (new["version"], new["systemPrompt"], new["limits"]["maxSteps"]) == (2, "Review strictly.", 4)
    assert new["limits"]["timeoutMs"] == agent["limits"]["timeoutMs"] and new["invoke"] == agent["invoke"]
    # A write against the version it no longer is: 412, and nothing changes.
    stale = await gateway_http.patch(
        "/api/agents/reviewer", json={"systemPrompt": "late"}, headers={**h, "If-Match": '"1"'}
    )
    assert stale.status_code == 412
    assert stale.json() == _error(
        412, "VERSION_MISMATCH", "agent 'reviewer' is at version 2, not 1: read it again and redo the change"
    )
    assert (await gateway_http.get("/api/agents/reviewer", headers=h)).json()["agent"] == new
    # null resets a field to its default; a weak ETag or a bare number names a version too.
    reset = await gateway_http.patch(
        "/api/agents/reviewer", json={"invoke": None}, headers={**h, "If-Match": 'W/"2"'}
    )
    assert reset.status_code == 200 and reset.json()["agent"]["invoke"] == to_dict(rules.DEFAULT_INVOKE)
    # What a client read back may be sent back: output-only fields are ignored.
    back = {**reset.json()["agent"], "name": "Strict reviewer"}
    resent = await gateway_http.patch("/api/agents/reviewer", json=back, headers={**h, "If-Match": "3"})
    assert (resent.status_code, resent.json()["agent"]["version"]) == (200, 4)
    # Without If-Match the write is not checked; a body that gives nothing changes nothing.
    assert (await gateway_http.patch("/api/agents/reviewer", json={}, headers=h)).headers["etag"] == '"4"'
    bad_match = await gateway_http.patch("/api/agents/reviewer", json={}, headers={**h, "If-Match": "v4"})
    assert bad_match.status_code == 422 and "If-Match" in bad_match.json()["error"]["message"]
    renamed = await gateway_http.patch("/api/agents/reviewer", json={"slug": "other"}, headers=h)
    assert renamed.status_code == 422 and "slug cannot change" in renamed.json()["error"]["message"]

    stale_delete = await gateway_http.delete("/api/agents/reviewer", headers={**h, "If-Match": '"3"'})
    assert stale_delete.status_code == 412
    deleted = await gateway_http.delete("/api/agents/reviewer", headers={**h, "If-Match": '"4"'})
    assert (deleted.status_code, deleted.json()) == (200, {"deleted": True})
    gone = await gateway_http.get("/api/agents/reviewer", headers=h)
    assert (gone.status_code, gone.json()) == (404, _error(404, "NOT_FOUND", "unknown agent 'reviewer'"))
    assert (await gateway_http.delete("/api/agents/reviewer", headers=h)).status_code == 404


async def test_another_users_agent_is_a_404_like_a_missing_one(gateway_http, auth_stub, unique):
    owner, other = await _auth(auth_stub, f"u-{unique}"), await _auth(auth_stub, f"o-{unique}")
    assert (
        await gateway_http.post("/api/agents", json={"slug": "mine", "name": "Mine"}, headers=owner)
    ).status_code == 201
    missing = _error(404, "NOT_FOUND", "unknown agent 'mine'")
    for method, path, body in (
        ("GET", "/api/agents/mine", None),
        ("PATCH", "/api/agents/mine", {"name": "Theirs"}),
        ("DELETE", "/api/agents/mine", None),
        ("POST", "/api/agents/mine/clone", None),
    ):
        resp = await gateway_http.request(method, path, json=body, headers=other)
        assert (resp.status_code, resp.json()) == (404, missing), (method, path)
    listed = (await gateway_http.get("/api/agents", headers=other)).json()["agents"]
    assert "mine" not in [a["slug"] for a in listed]
    # The owner still has it, unchanged.
    assert (await gateway_http.get("/api/agents/mine", headers=owner)).json()["agent"]["version"] == 1


async def test_builtins_are_read_only_and_clone_to_change(gateway_http, auth_stub, unique):
    h = await _auth(auth_stub, f"u-{unique}")
    refused = await gateway_http.patch("/api/agents/general", json={"systemPrompt": "x"}, headers=h)
    assert refused.status_code == 403
    assert refused.json() == _error(
        403, "PERMISSION_DENIED", "built-in agent 'general' is read-only: clone it to change it"
    )
    assert (await gateway_http.delete("/api/agents/general", headers=h)).status_code == 403
    general = (await gateway_http.get("/api/agents/general", headers=h)).json()["agent"]
    clone = await gateway_http.post("/api/agents/general/clone", headers=h)
    assert (clone.status_code, clone.headers["etag"]) == (201, '"1"')
    copy = clone.json()["agent"]
    assert (copy["slug"], copy["name"], copy["owner"]) == (
        "general-copy",
        "General Assistant (copy)",
        f"u-{unique}",
    )
    assert (
        copy["systemPrompt"] == general["systemPrompt"]
        and copy["subagentConfig"] == general["subagentConfig"]
    )
    named = await gateway_http.post(
        "/api/agents/general/clone", json={"newSlug": "my-general", "name": "My general"}, headers=h
    )
    assert (named.status_code, named.json()["agent"]["slug"]) == (201, "my-general")
    taken = await gateway_http.post("/api/agents/general/clone", json={"newSlug": "my-general"}, headers=h)
    assert taken.status_code == 409 and taken.json()["error"]["reason"] == "ALREADY_EXISTS"
    extra = await gateway_http.post("/api/agents/general/clone", json={"slug": "x"}, headers=h)
    assert extra.status_code == 422
    changed = await gateway_http.patch(
        "/api/agents/my-general", json={"systemPrompt": "Mine."}, headers={**h, "If-Match": '"1"'}
    )
    assert changed.json()["agent"]["systemPrompt"] == "Mine."
    assert (await gateway_http.get("/api/agents/general", headers=h)).json()["agent"] == general


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"tools": ["shell"]}, "tools: unknown tool 'shell'"),
        ({"invoke": {"allowedCallees": ["ghost"]}}, "invoke.allowedCallees: unknown agent 'ghost'"),
        (
            {"subagentConfig": {"allowedPresetAgentIds": ["ghost"]}},
            "subagentConfig.allowedPresetAgentIds: unknown agent 'ghost'",
        ),
        ({"limits": {"maxSteps": 1000}}, "limits.maxSteps must be 1-100"),
        ({"subagentConfig": {"timeoutMs": 5}}, "subagentConfig.timeoutMs must be 100-3600000"),
        (
            {"subagentConfig": {"allowedToolNames": ["delegate_parallel"]}},
            "subagentConfig.allowedToolNames: 'delegate_parallel' is blocked for every subagent by the mesh",
        ),
        ({"slug": "Bad Slug"}, "slug must be 1-100 characters of [a-z0-9_-]"),
        ({"nonsense": 1}, 'Message type "agentmesh.agents.v1.Agent" has no field named "nonsense"'),
        ({"limits": {"maxSteps": "many"}}, "Failed to parse maxSteps field"),
    ],
)
async def test_bad_agents_are_a_422_naming_the_field(gateway_http, auth_stub, unique, body, message):
    h = await _auth(auth_stub, f"u-{unique}")
    created = await gateway_http.post("/api/agents", json={"slug": "fine", "name": "Fine", **body}, headers=h)
    assert created.status_code == 422, created.text
    error = created.json()["error"]
    assert (error["code"], error["reason"]) == (422, "INVALID_ARGUMENT") and message in error["message"]
    if "slug" not in body:
        assert (
            await gateway_http.post("/api/agents", json={"slug": "fine", "name": "Fine"}, headers=h)
        ).status_code == 201
        patched = await gateway_http.patch("/api/agents/fine", json=body, headers=h)
        assert patched.status_code == 422 and message in patched.json()["error"]["message"]
        assert (await gateway_http.get("/api/agents/fine", headers=h)).json()["agent"]["version"] == 1
    for raw in ("[1, 2]", "not json"):
        resp = await gateway_http.post(
            "/api/agents", content=raw, headers={**h, "Content-Type": "application/json"}
        )
        assert resp.status_code == 422 and "JSON object" in resp.json()["error"]["message"]


async def test_options(gateway_http, auth_stub, unique):
    h = await _auth(auth_stub, f"u-{unique}")
    await gateway_http.post("/api/agents", json={"slug": "own", "name": "Own"}, headers=h)
    resp = await gateway_http.get("/api/agents/options", headers=h)
    assert resp.status_code == 200, resp.text
    options = resp.json()
    # The background subagents' tools are never chosen: they come with the delegate tools.
    chosen = [n for n in tools.BUILTIN.specs if n not in tools.BACKGROUND_TOOLS]
    assert [t["name"] for t in options["tools"]] == chosen
    assert {t["name"]: t["roles"] for t in options["tools"]} == {
        "agent-invoke": ["supervisor", "subagent", "a2a-callee"],
        "delegate_task": ["supervisor"],
        "delegate_parallel": ["supervisor"],
        "clarify": ["supervisor"],
    }
    assert [c["slug"] for c in options["presetAgents"]] == ["coder", "general", "own", "researcher"]
    assert options["callees"][0] == {"slug": "*", "name": "Any agent", "owner": ""}
    assert {"field": "invoke.maxParallel", "min": 1, "max": 32} in options["ranges"]
    assert options["defaults"]["limits"] == to_dict(rules.DEFAULT_LIMITS)
    assert options["blockedToolNames"] == tools_blocked()


async def test_agent_routes_need_a_key_and_the_a2a_stream_route_stays(gateway_http, auth_stub, unique):
    for method, path in (("GET", "/api/agents"), ("GET", "/api/agents/options"), ("POST", "/api/agents")):
        assert (await gateway_http.request(method, path)).status_code == 401
    h = await _auth(auth_stub, f"u-{unique}")
    # /api/agents/a2a/stream is the agent-invoke panel's stream route (its end to end tests are in
    # tests/integration/agent_runtime and tests/e2e/ui), not the agent "a2a"; /api/agents/a2a is that agent.
    resp = await gateway_http.get("/api/agents/a2a/stream", params={"taskId": "nope"}, headers=h)
    assert "unknown agent" not in resp.text
    no_task = await gateway_http.get("/api/agents/a2a/stream", headers=h)
    assert no_task.status_code == 422 and no_task.json()["error"]["details"][0]["loc"] == ["query", "taskId"]
    agent = await gateway_http.get("/api/agents/a2a", headers=h)
    assert agent.json() == _error(404, "NOT_FOUND", "unknown agent 'a2a'")
