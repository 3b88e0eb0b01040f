"""What the OpenAPI document (GET /openapi.json) says a route answers with 200: the JSON bodies, with
the mesh's resources as components whose schemas come from the protobuf descriptors the same way
libs/protojson.py serialises them, so the document follows the protos. (Error answers: gateway/errors.py.)
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from agentmesh.agents.v1 import agent_pb2 as ag
from agentmesh.trace.v1 import trace_pb2 as tp
from libs.protojson import json_schema

_COMPONENTS = {"Session": tp.Trace.DESCRIPTOR, "Message": tp.Message.DESCRIPTOR, "Agent": ag.Agent.DESCRIPTOR}
_REFS = {desc.full_name: f"#/components/schemas/{name}" for name, desc in _COMPONENTS.items()}

SESSION = {"$ref": "#/components/schemas/Session"}
MESSAGE = {"$ref": "#/components/schemas/Message"}
AGENT = {"$ref": "#/components/schemas/Agent"}
INTEGER = {"type": "integer", "minimum": 0}


def obj(**properties: Any) -> dict[str, Any]:
    """An object with exactly these properties, all present."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def ok(schema: dict[str, Any], description: str = "Successful Response") -> dict[int | str, dict[str, Any]]:
    """`responses=` entry for a 200 JSON body."""
    return {200: {"description": description, "content": {"application/json": {"schema": schema}}}}


def install(app: FastAPI) -> None:
    """Adds the resource components to the app's document."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = base()
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            for name, desc in _COMPONENTS.items():
                schemas[name] = json_schema(desc, _REFS)
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]
