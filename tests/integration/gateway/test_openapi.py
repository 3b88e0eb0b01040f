"""The gateway's OpenAPI document (GET /openapi.json) states every answer a route gives and every bound
it checks, from the same tables the gateway uses (schemathesis checks that service and document agree:
tests/integration/gateway/test_schemathesis.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from agentmesh.agents.v1 import agent_pb2 as ag
from agentmesh.gateway.app import create_app
from agentmesh.gateway.params import ID_PATTERN, MESSAGE_PATTERN, OFFSET_PATTERN, TRACE_ID_PATTERN
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import TABLE
from agentmesh.libs.ids import SLUG_PATTERN
from agentmesh.libs.protojson import to_json
from agentmesh.trace.v1 import trace_pb2 as tp

STREAMS = {
    "/api/sessions/{session_id}/stream",
    "/api/agents/a2a/stream",
    "/api/subagents/{subagent_id}/stream",
}
# Every operation, with the error statuses it can answer (besides 414 and 431, which every route has).
ERRORS = {
    ("GET", "/healthz"): set(),
    ("POST", "/api/chat"): {401, 404, 409, 413, 422, 429, 503, 504},
    ("POST", "/api/sessions/{session_id}/cancel"): {401, 404, 422, 503, 504},
    ("POST", "/api/subagents/{subagent_id}/cancel"): {401, 404, 422, 503, 504},
    ("GET", "/api/agents"): {401, 503, 504},
    ("GET", "/api/agents/options"): {401, 503, 504},
    ("GET", "/api/agents/{slug}"): {401, 404, 422, 503, 504},
    ("POST", "/api/agents"): {401, 404, 409, 413, 422, 503, 504},
    ("PATCH", "/api/agents/{slug}"): {401, 403, 404, 412, 413, 422, 503, 504},
    ("DELETE", "/api/agents/{slug}"): {401, 403, 404, 412, 422, 503, 504},
    ("POST", "/api/agents/{slug}/clone"): {401, 404, 409, 413, 422, 503, 504},
    ("GET", "/api/sessions"): {401, 422, 503, 504},
    ("DELETE", "/api/sessions"): {401, 503, 504},
    ("GET", "/api/runs"): {401, 422, 503, 504},
    ("GET", "/api/sessions/{session_id}"): {401, 404, 422, 503, 504},
    ("PATCH", "/api/sessions/{session_id}"): {401, 404, 413, 422, 503, 504},
    ("DELETE", "/api/sessions/{session_id}"): {401, 404, 422, 503, 504},
    ("GET", "/api/sessions/{session_id}/messages"): {401, 404, 422, 503, 504},
    **{("GET", path): {401, 404, 422, 503, 504} for path in STREAMS},
    # the trace API: 403 for an id naming an unregistered peer (or a peer that refused our key)
    ("GET", "/api/traces/{trace_id}"): {401, 403, 404, 422, 503, 504},
    ("GET", "/api/traces/{trace_id}/messages"): {401, 403, 404, 422, 503, 504},
    ("POST", "/api/traces/{trace_id}/messages"): {401, 403, 404, 409, 413, 422, 503, 504},
    ("POST", "/api/traces/{trace_id}/run"): {401, 403, 404, 409, 413, 422, 429, 503, 504},
}


@pytest.fixture(scope="module")
async def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    app = create_app(MeshSettings(data_dir=tmp_path_factory.mktemp("openapi")))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        r = await http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()  # type: ignore[no-any-return]


def operation(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return document["paths"][path][method.lower()]  # type: ignore[no-any-return]


def parameter(op: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [p for p in op.get("parameters", []) if p["name"] == name]
    return found  # type: ignore[no-any-return]


def test_every_operation_and_its_error_answers(document: dict[str, Any]) -> None:
    listed = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    assert listed == set(ERRORS)
    for (method, path), errors in ERRORS.items():
        responses = operation(document, method, path)["responses"]
        ok = 201 if method == "POST" and path.startswith("/api/agents") else 200
        assert {int(s) for s in responses} == {ok, 414, 431, *errors}, (method, path)
        for status in {414, 431, *errors}:
            schema = responses[str(status)]["content"]["application/json"]["schema"]
            error = schema["properties"]["error"]
            assert schema["required"] == ["error"] and error["required"] == ["code", "reason", "message"]
            assert error["properties"]["code"] == {"type": "integer", "const": status}
            reasons = error["properties"]["reason"]["enum"]
            assert reasons, status
            assert all(TABLE[r].http == status for r in reasons if status not in (414, 431)), (
                status,
                reasons,
            )
        if path.startswith("/api/"):
            assert operation(document, method, path)["security"] == [{"HTTPBearer": []}]
    unauthenticated = operation(document, "POST", "/api/chat")["responses"]["401"]["content"]
    assert unauthenticated["application/json"]["schema"]["properties"]["error"]["properties"]["reason"] == {
        "type": "string",
        "enum": ["UNAUTHENTICATED"],
    }
    assert document["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"


def test_streams_are_event_streams(document: dict[str, Any]) -> None:
    chat = operation(document, "POST", "/api/chat")["responses"]["200"]["content"]
    assert set(chat) == {"text/event-stream"}
    assert chat["text/event-stream"]["schema"]["required"] == ["data"]
    for path in STREAMS:
        op = operation(document, "GET", path)
        content = op["responses"]["200"]["content"]
        assert set(content) == {"text/event-stream", "application/json"}  # events, or "no-buffer"
        assert content["application/json"]["schema"]["properties"]["reason"] == {"const": "no-buffer"}
        for name, where in (("Last-Event-ID", "header"), ("lastEventId", "query")):
            resume = parameter(op, name)
            assert (resume["in"], resume["schema"]["pattern"]) == (where, OFFSET_PATTERN)


def test_the_bounds_the_gateway_checks(document: dict[str, Any]) -> None:
    messages = operation(document, "GET", "/api/sessions/{session_id}/messages")
    limit = parameter(messages, "limit")["schema"]
    assert (limit["minimum"], limit["maximum"]) == (0, 1000)
    offset = parameter(messages, "offset")["schema"]
    assert (offset["minimum"], offset["maximum"]) == (0, 2**31 - 1)
    assert parameter(messages, "mode")["schema"]["enum"] == ["main_path", "all"]
    listing = operation(document, "GET", "/api/sessions")
    page_size = parameter(listing, "page_size")["schema"]
    assert (page_size["minimum"], page_size["maximum"]) == (0, 200)
    page_token = parameter(listing, "page_token")["schema"]
    assert (page_token["maxLength"], page_token["pattern"]) == (512, "^[A-Za-z0-9_-]*$")
    runs = operation(document, "GET", "/api/runs")
    assert parameter(runs, "page_token")["schema"] == page_token
    assert parameter(runs, "state")["schema"]["anyOf"][0]["enum"] == [
        "running",
        "done",
        "failed",
        "cancelled",
        "interrupted",
    ]
    assert parameter(runs, "kind")["schema"]["anyOf"][0]["enum"] == ["chat", "callee", "subagent", "a2a"]
    agent = parameter(runs, "agent")["schema"]
    assert (agent["pattern"], agent["maxLength"]) == (f"^(?:{SLUG_PATTERN})?$", 100)
    for method, path in ERRORS:
        for p in operation(document, method, path).get("parameters", []):
            if p["name"] in ("session_id", "subagent_id", "taskId"):
                assert (p["schema"]["pattern"], p["schema"]["maxLength"]) == (ID_PATTERN, 64), (path, p)
            if p["name"] == "slug":
                assert (p["schema"]["pattern"], p["schema"]["maxLength"]) == (f"^{SLUG_PATTERN}$", 100)
            if p["name"] == "trace_id":
                assert (p["schema"]["pattern"], p["schema"]["maxLength"]) == (TRACE_ID_PATTERN, 300), p
            if p["name"] == "If-Match":
                assert (method, p["in"]) in {("PATCH", "header"), ("DELETE", "header")}

    schemas = document["components"]["schemas"]
    chat = schemas["ChatRequest"]
    assert chat["additionalProperties"] is False and chat["required"] == ["agent", "message"]
    message = chat["properties"]["message"]
    assert (message["minLength"], message["maxLength"], message["pattern"]) == (1, 100_000, MESSAGE_PATTERN)
    body = operation(document, "POST", "/api/agents")["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/AgentInput"}
    assert schemas["AgentInput"]["properties"]["name"]["anyOf"][0] == {
        "type": "string",
        "pattern": "^[^\\x00]*$",
    }
    title = schemas["SessionPatch"]["properties"]["title"]
    assert (title["minLength"], title["maxLength"], title["pattern"]) == (1, 500, "^[^\\x00]*$")


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Session", tp.Trace(id="t", create_time={"seconds": 1})),
        ("Message", tp.Message()),
        ("Run", tp.Run(start_time={"seconds": 1})),
        ("Agent", ag.Agent()),
        ("Agent", ag.Agent(subagent_config=ag.SubagentConfig(enabled=True))),
    ],
)
def test_resource_components_are_what_protojson_writes(
    document: dict[str, Any], name: str, message: Any
) -> None:
    schema = document["components"]["schemas"][name]
    written = to_json(message)
    assert schema["additionalProperties"] is False
    assert set(schema["required"]) <= set(written) <= set(schema["properties"])


async def test_the_document_is_served_as_json(tmp_path: Path) -> None:
    app = create_app(MeshSettings(data_dir=tmp_path))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        r = await http.get("/openapi.json")
    assert r.headers["content-type"] == "application/json" and r.json()["openapi"].startswith("3.1")


def _integer_schemas(node: Any) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if node.get("type") == "integer":
            found.append(node)
        for value in node.values():
            found += _integer_schemas(value)
    elif isinstance(node, list):
        for value in node:
            found += _integer_schemas(value)
    return found


def test_integer_bounds_are_integers(document: dict[str, Any]) -> None:
    """Issue 39, point 5: parentSequence's maximum read 9.223372036854776e+18 (2**63, not 2**63 - 1)."""
    bounds = [
        (key, schema[key])
        for schema in _integer_schemas(document)
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
        if key in schema
    ]
    assert bounds and all(type(value) is int for _, value in bounds), [
        b for b in bounds if type(b[1]) is not int
    ]
    append = document["components"]["schemas"]["AppendBody"]["properties"]["parentSequence"]["anyOf"][0]
    assert append["maximum"] == 2**63 - 1
    chat = document["components"]["schemas"]["ChatRequest"]["properties"]["parentSequence"]["anyOf"][0]
    assert chat["maximum"] == 2**53 - 1
