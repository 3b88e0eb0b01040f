"""The A2A endpoint's JSON-RPC errors say nothing of the gateway's insides (issue 39, point 4)."""

from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from agentmesh.gateway.a2a.routes import without_internals


def test_an_internal_error_says_only_that() -> None:
    raw = {
        "jsonrpc": "2.0",
        "id": 4,
        "error": {"code": -32603, "message": "<AioRpcError: ipv4:127.0.0.1:50313 Connection refused>"},
    }
    answer = json.loads(bytes(without_internals(JSONResponse(raw)).body))
    assert answer == {"jsonrpc": "2.0", "id": 4, "error": {"code": -32603, "message": "Internal error"}}


def test_other_answers_pass_as_they_are() -> None:
    for raw in (
        {"jsonrpc": "2.0", "id": 1, "error": {"code": -32602, "message": "invalid page_token"}},
        {"jsonrpc": "2.0", "id": 1, "result": {"task": {}}},
    ):
        assert json.loads(bytes(without_internals(JSONResponse(raw)).body)) == raw
