"""Deadlines, size limits and auth checks that are not covered by the feature suites."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import websockets

from agentmesh.v1 import stream_service_pb2 as ss
from agentmesh.v1 import stream_service_pb2_grpc
from libs.rpc import channel
from tests.mesh import Mesh, chat, start_mesh

CATALOG = Path(__file__).parent / "catalogs" / "mesh.yaml"


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    m = await start_mesh(tmp_path_factory.mktemp("limits"), catalog=CATALOG, rules={"rules": []})
    yield m
    await m.stop()


async def test_every_outgoing_rpc_gets_a_deadline(mesh: Mesh) -> None:
    """A subscription on an idle open buffer, made without a timeout, ends at the channel's default."""
    assert mesh.clients is not None
    key = "session:deadline-probe"
    await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key, owner="alice"))
    async with channel(mesh.settings.addresses.stream, unary_timeout_s=0.3, stream_timeout_s=0.3) as ch:
        stub = stream_service_pb2_grpc.StreamServiceStub(ch)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(5):
                async for _ in stub.SubscribeStream(ss.SubscribeStreamRequest(key=key)):
                    pass
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_message_size_limit(mesh: Mesh) -> None:
    async with mesh.http() as http:
        r = await http.post("/api/chat", json={"agent": "general", "message": "x" * 100_001})
    assert r.status_code == 422 and r.json()["error"]["reason"] == "INVALID_ARGUMENT"


async def test_websocket_needs_a_key(mesh: Mesh) -> None:
    url = mesh.url.replace("http://", "ws://") + "/api/ws"
    for headers in ({}, {"Authorization": "Bearer am_wrong"}):
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            async with websockets.connect(url, additional_headers=headers) as ws:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 4401
    async with websockets.connect(f"{url}?apiKey={mesh.api_key}") as ws:
        await ws.send(json.dumps({"type": "chat", "agent": "general", "message": ""}))
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply["type"] == "error" and reply["status"] == 422
        await ws.send("not json")
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply["type"] == "error" and reply["status"] == 422


def tool_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "rules": [
            {
                "system": r"\[general\]",
                "after_tool": False,
                "tool_calls": [{"name": name, "arguments": arguments}],
            },
            {"system": r"\[general\]", "after_tool": True, "text": "{tool_results}"},
        ]
    }


async def test_agent_invoke_parallel_limit(mesh: Mesh) -> None:
    mesh.mock.set_rules(tool_call("agent-invoke", {"agentSlug": "coder", "input": ["a", "b", "c", "d"]}))
    events = await chat(mesh, "general", "too many")
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and "at most 3" in out["output"]["error"]
    assert "a2a-task-started" not in [e["type"] for e in events]


async def test_delegate_batch_size_limit(mesh: Mesh) -> None:
    mesh.mock.set_rules(tool_call("delegate_parallel", {"tasks": [{"goal": f"g{i}"} for i in range(11)]}))
    events = await chat(mesh, "general", "too many subtasks")
    out = next(e for e in events if e["type"] == "tool-output-available")
    assert out["ok"] is False and "between 1 and 10" in out["output"]["error"]
    assert not [e for e in events if e["type"].startswith("subagent-")]


async def test_run_step_limit(mesh: Mesh) -> None:
    """A model that never stops calling tools ends at the agent's step limit (maxSteps)."""
    mesh.mock.set_rules(
        {
            "rules": [
                {
                    "system": r"\[general\]",
                    "tool_calls": [
                        {"name": "agent-invoke", "arguments": {"agentSlug": "ghost", "input": "x"}}
                    ],
                }
            ]
        }
    )
    events = await chat(mesh, "general", "loop forever")
    assert events[-2]["type"] == "finish" and events[-2]["finishReason"] == "max-steps"
    assert sum(1 for e in events if e["type"] == "tool-input-available") == 8


async def test_request_body_limit(mesh: Mesh) -> None:
    big = json.dumps({"agent": "general", "message": "x" * (1024 * 1024)})
    async with mesh.http() as http:
        r = await http.post("/api/chat", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["reason"] == "RESOURCE_EXHAUSTED"

        async def chunks():  # no content-length: the limit counts what arrives
            for _ in range(20):
                yield b"x" * 65536

        r = await http.post("/api/chat", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
