"""What the OpenAPI document (GET /openapi.json) says a route answers with 200: the JSON bodies, with
the mesh's resources as components whose schemas come from the protobuf descriptors the same way
libs/protojson.py serialises them, so the document follows the protos. (Error answers: gateway/errors.py.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from agentmesh.agents.v1 import agent_pb2 as ag
from agentmesh.agents.v1 import agent_service_pb2 as ags
from agentmesh.gateway.params import NO_NUL
from agentmesh.libs.protojson import json_input_schema, json_schema
from agentmesh.trace.v1 import trace_pb2 as tp

_COMPONENTS = {
    "Session": tp.Trace.DESCRIPTOR,
    "Message": tp.Message.DESCRIPTOR,
    "Run": tp.Run.DESCRIPTOR,
    "Agent": ag.Agent.DESCRIPTOR,
    "AgentOptions": ags.GetAgentOptionsResponse.DESCRIPTOR,
}
_REFS = {desc.full_name: f"#/components/schemas/{name}" for name, desc in _COMPONENTS.items()}

SESSION = {"$ref": "#/components/schemas/Session"}
MESSAGE = {"$ref": "#/components/schemas/Message"}
RUN = {"$ref": "#/components/schemas/Run"}
TRACE = SESSION  # a session is a trace as a user sees it: one resource
AGENT = {"$ref": "#/components/schemas/Agent"}
AGENT_OPTIONS = {"$ref": "#/components/schemas/AgentOptions"}
AGENT_INPUT = {"$ref": "#/components/schemas/AgentInput"}


def _no_nul(schema: Any) -> Any:
    """Every string of `schema` without U+0000 (the gateway refuses it: PostgreSQL cannot store it)."""
    if isinstance(schema, dict):
        out = {k: _no_nul(v) for k, v in schema.items()}
        if out.get("type") == "string" and "pattern" not in out and "format" not in out:
            out["pattern"] = NO_NUL
        return out
    if isinstance(schema, list):
        return [_no_nul(v) for v in schema]
    return schema


INTEGER = {"type": "integer", "minimum": 0}


def obj(**properties: Any) -> dict[str, Any]:
    """An object with exactly these properties, all present."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def ok(
    schema: dict[str, Any], description: str = "Successful Response", links: dict[str, Any] | None = None
) -> dict[int | str, dict[str, Any]]:
    """`responses=` entry for a 200 JSON body (with OpenAPI links to what its ids open)."""
    response: dict[str, Any] = {
        "description": description,
        "content": {"application/json": {"schema": schema}},
    }
    if links:
        response["links"] = links
    return {200: response}


def _ref(method: str, path: str) -> str:
    return "#/paths/" + path.replace("~", "~0").replace("/", "~1") + "/" + method.lower()


SESSION_OPERATIONS = [
    ("GET", "/api/sessions/{session_id}"),
    ("PATCH", "/api/sessions/{session_id}"),
    ("DELETE", "/api/sessions/{session_id}"),
    ("GET", "/api/sessions/{session_id}/messages"),
    ("GET", "/api/sessions/{session_id}/stream"),
    ("POST", "/api/sessions/{session_id}/cancel"),
]
AGENT_OPERATIONS = [
    ("GET", "/api/agents/{slug}"),
    ("PATCH", "/api/agents/{slug}"),
    ("DELETE", "/api/agents/{slug}"),
    ("POST", "/api/agents/{slug}/clone"),
]


def links(operations: list[tuple[str, str]], parameter: str, pointer: str) -> dict[str, Any]:
    """OpenAPI links from a response to `operations`, their `parameter` taken at `pointer` in its body
    (the stateful phase of tests/integration/gateway/test_schemathesis.py follows them)."""
    return {
        f"{method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '')}": {
            "operationRef": _ref(method, path),
            "parameters": {parameter: f"$response.body#{pointer}"},
        }
        for method, path in operations
    }


def session_links(pointer: str) -> dict[str, Any]:
    return links(SESSION_OPERATIONS, "session_id", pointer)


def agent_links(pointer: str) -> dict[str, Any]:
    return links(AGENT_OPERATIONS, "slug", pointer)


# FastAPI's OpenAPI model holds every bound as a float (`maximum: 9.223372036854776e+18` for 2**63 - 1):
# the bounds of integer schemas are written back as the integers they were. A float at or past 2**53 is
# not exact, so it maps back through the bounds the routes use; any other is refused.
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_EXACT = {float(v): v for v in (2**31 - 1, 2**32 - 1, 2**53 - 1, 2**53, 2**63 - 1, 2**64 - 1)}


def _integer_bounds(node: Any) -> None:
    """Every integer schema under `node` with its bounds as JSON integers."""
    if isinstance(node, list):
        for item in node:
            _integer_bounds(item)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "integer":
        for key in _BOUND_KEYS:
            value = node.get(key)
            if isinstance(value, float):
                if value in _EXACT:
                    node[key] = _EXACT[value]
                elif value.is_integer() and abs(value) < 2**53:
                    node[key] = int(value)
                else:
                    raise ValueError(f"an integer bound the document cannot state exactly: {value!r}")
    for value in node.values():
        _integer_bounds(value)


def install(app: FastAPI) -> None:
    """Adds the resource components to the app's document, and states integer bounds as integers."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = base()
            _integer_bounds(document)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, desc in _COMPONENTS.items():
                schemas[name] = json_schema(desc, _REFS)
            # An agent as a write takes it (gateway/routes/agents.py): what ParseDict takes.
            schemas["AgentInput"] = _no_nul(json_input_schema(ag.Agent.DESCRIPTOR))
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
