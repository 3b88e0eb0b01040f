"""Our agents as A2A servers, driven by the official a2a-sdk client over JSON-RPC and gRPC (and its
v0.3 compatibility mode): discovery, send, stream, get, list, cancel (the whole tree), resubscribe after
a dropped connection with no gap and no duplicate, auth failures, another user's task; on SQLite +
memory and PostgreSQL + Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol

from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from libs import identity
from tests.a2a.clients import sdk_client, state_of, text_message, text_of
from tests.mesh import BACKENDS, Mesh, mesh_on, wait_until

CATALOG = Path(__file__).parent / "catalog.yaml"
RULES: dict[str, Any] = {
    "rules": [
        {"system": r"\[echo\]", "text": "echo: {user}"},
        {"system": r"\[streamer\]", "text": "one two three four five six seven eight", "tokens_per_second": 20},
        {"system": r"\[worker\]", "fault": "stall"},
        {
            "system": r"\[boss\]",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "worker", "input": "{user}"}}],
        },
        {"system": r"\[boss\]", "after_tool": True, "text": "boss done: {tool_results}"},
    ],
    "default": {"text": "default reply"},
}


@pytest.fixture(scope="module", params=BACKENDS)
async def mesh(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    m = await mesh_on(request, tmp_path_factory.mktemp("a2a-server"), rules=RULES, catalog=CATALOG)
    yield m
    await m.stop()


async def task_row(mesh: Mesh, task_id: str) -> tp.A2ATask:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        return (await mesh.clients.trace.GetA2ATask(ts.GetA2ATaskRequest(task_id=task_id))).task


async def messages_of(mesh: Mesh, trace_id: str) -> list[tp.Message]:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.trace.ListMessages(ts.ListMessagesRequest(trace_id=trace_id))
    return list(resp.messages)


async def test_card_discovery(mesh: Mesh) -> None:
    async with httpx.AsyncClient(base_url=mesh.url) as http:
        card = (await http.get("/a2a/echo/.well-known/agent-card.json")).json()
        default = await http.get("/.well-known/agent-card.json")
        hidden = await http.get("/a2a/hidden/.well-known/agent-card.json")
        unknown = await http.get("/a2a/nobody/.well-known/agent-card.json")
    assert card["name"] == "Echo Agent" and card["capabilities"]["streaming"] is True
    bindings = {(i["protocolBinding"], i["protocolVersion"]) for i in card["supportedInterfaces"]}
    assert bindings == {("JSONRPC", "1.0"), ("GRPC", "1.0"), ("JSONRPC", "0.3")}
    assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"
    assert default.json()["name"] == "General Assistant"
    assert hidden.status_code == unknown.status_code == 404
    assert hidden.json() == {**unknown.json(), "error": {**unknown.json()["error"], "message": hidden.json()["error"]["message"]}}


@pytest.mark.parametrize("binding", [TransportProtocol.JSONRPC, TransportProtocol.GRPC])
async def test_stream_persists_a_hidden_a2a_trace(mesh: Mesh, binding: str) -> None:
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, binding)
    responses = [r async for r in client.send_message(text_message("hello there"))]
    await client.close()
    assert text_of(responses) == "echo: hello there"
    assert state_of(responses[-1]) == a2a.TASK_STATE_COMPLETED
    first = responses[0].task
    task = await task_row(mesh, first.id)
    assert task.trace_id == first.context_id and task.state == tp.TASK_STATE_COMPLETED
    assert task.callee_agent == "echo" and not task.caller_session_id
    messages = await messages_of(mesh, task.trace_id)
    assert [(m.role, m.source, m.a2a_task_id) for m in messages] == [
        (tp.MESSAGE_ROLE_USER, tp.MESSAGE_SOURCE_A2A, first.id),
        (tp.MESSAGE_ROLE_ASSISTANT, tp.MESSAGE_SOURCE_A2A, first.id),
    ]
    assert messages[1].content == "echo: hello there"
    offsets = [r.artifact_update.metadata["offset"] for r in responses if r.HasField("artifact_update")]
    assert offsets and all(offsets)
