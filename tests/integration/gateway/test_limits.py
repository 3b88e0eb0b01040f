"""The gateway's limits: request bodies, chat message size, WebSocket authentication."""

from __future__ import annotations

import asyncio
import json

import pytest
import websockets

from tests.mesh import TEST_CATALOG, Mesh

pytestmark = pytest.mark.mesh(catalog=TEST_CATALOG, rules={"rules": []})


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
