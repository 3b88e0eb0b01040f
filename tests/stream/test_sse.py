"""The gateway's resumable SSE routes through a real uvicorn on a loopback port (real disconnects)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from httpx_sse import aconnect_sse

from agentmesh.v1 import events_pb2 as ev
from agentmesh.v1 import stream_service_pb2 as pb
from libs import events
from tests.mesh import wait_until
from tests.stream.conftest import Gateway, StreamFactory, StreamHarness

GatewayFactory = Callable[[StreamHarness], Awaitable[Gateway]]

ROUTES = [
    ("session:{}", "/api/sessions/{}/stream", {}),
    ("a2a:{}", "/api/agents/a2a/stream", {"taskId": "{}"}),
    ("subagent:{}", "/api/subagents/{}/stream", {}),
]


def route(index: int, ident: str) -> tuple[str, str, dict[str, str]]:
    key, path, params = ROUTES[index]
    if key.startswith("subagent:"):
        ident = str(int(ident, 16))  # subagent ids are integers (subagent_sessions rows)
    return key.format(ident), path.format(ident), {k: v.format(ident) for k, v in params.items()}


async def open_buffer(h: StreamHarness, key: str, owner: str = "alice", n: int = 0) -> list[str]:
    await h.stub.CreateStream(pb.CreateStreamRequest(key=key, owner=owner))
    return await push(h, key, n)


async def push(h: StreamHarness, key: str, n: int, start: int = 0) -> list[str]:
    if not n:
        return []
    batch = [events.reasoning_delta(f"r{i}") for i in range(start, start + n)]  # never coalesced
    return list((await h.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=batch))).offsets)


async def finish(h: StreamHarness, key: str) -> str:
    return (await h.stub.CloseStream(pb.CloseStreamRequest(key=key, done=ev.Done()))).offset


@pytest.fixture
async def gw(stream: StreamHarness, gateway_factory: GatewayFactory) -> Gateway:
    return await gateway_factory(stream)


@pytest.mark.parametrize("which", [0, 1, 2], ids=["session", "a2a", "subagent"])
async def test_replay_then_live_with_ids(gw: Gateway, unique: str, which: int) -> None:
    key, path, params = route(which, unique)
    early = await open_buffer(gw.stream, key, n=3)
    got: list[tuple[str, dict[str, Any]]] = []
    async with aconnect_sse(gw.client, "GET", path, params=params) as source:
        assert source.response.status_code == 200
        assert source.response.headers["content-type"].startswith("text/event-stream")
        assert source.response.headers["x-stream-resume"] == "true"
        live: list[str] = []
        async for sse in source.aiter_sse():
            got.append((sse.id, json.loads(sse.data)))
            if len(got) == 3:  # replay complete: now live events
                live = await push(gw.stream, key, 2, start=3)
                live.append(await finish(gw.stream, key))
    assert [i for i, _ in got] == early + live
    assert [d["type"] for _, d in got] == ["reasoning-delta"] * 5 + ["done"]
    assert [d.get("reasoningDelta") for _, d in got][:5] == [f"r{i}" for i in range(5)]


async def test_resume_with_last_event_id(gw: Gateway, unique: str) -> None:
    key, path, _ = route(0, unique)
    offsets = await open_buffer(gw.stream, key, n=10)
    first: list[str] = []
    async with aconnect_sse(gw.client, "GET", path) as source:
        async for sse in source.aiter_sse():
            first.append(sse.id)
            if len(first) == 4:
                break  # the client drops mid-stream
    await wait_until(lambda: gw.stream.backend.subscribers == 0, 5, "the dropped subscription to end")
    offsets += await push(gw.stream, key, 5, start=10)
    offsets.append(await finish(gw.stream, key))

    async def rest(**kw: Any) -> list[str]:
        async with aconnect_sse(gw.client, "GET", path, **kw) as source:
            return [sse.id async for sse in source.aiter_sse()]

    by_header = await rest(headers={"Last-Event-ID": first[-1]})
    by_query = await rest(params={"lastEventId": first[-1]})
    assert first + by_header == offsets  # no gap, no duplicate
    assert by_query == by_header
    assert await rest(headers={"Last-Event-ID": offsets[-1]}) == []  # nothing after the terminal event


async def test_disconnect_ends_server_subscription(gw: Gateway, unique: str) -> None:
    key, path, _ = route(2, unique)
    await open_buffer(gw.stream, key)
    async with gw.client.stream("GET", path) as resp:
        assert resp.status_code == 200
        await wait_until(lambda: gw.stream.backend.subscribers == 1, 5, "the subscription to start")
    await wait_until(lambda: gw.stream.backend.subscribers == 0, 5, "the subscription to end on disconnect")


@pytest.mark.parametrize("which", [0, 1, 2], ids=["session", "a2a", "subagent"])
async def test_foreign_reader_is_not_found(gw: Gateway, unique: str, which: int) -> None:
    # (The no-buffer answer needs the trace service to prove ownership: tests/test_agent_invoke.py.)
    key, path, params = route(which, unique)
    await open_buffer(gw.stream, key, owner="alice", n=1)
    resp = await gw.client.get(path, params=params, headers={"Authorization": f"Bearer {gw.keys['bob']}"})
    assert resp.status_code == 404
    assert resp.json()["error"]["reason"] == "NOT_FOUND"
    assert gw.stream.backend.subscribers == 0


async def test_a2a_requires_task_id(gw: Gateway) -> None:
    for params in ({}, {"taskId": ""}):
        resp = await gw.client.get("/api/agents/a2a/stream", params=params)
        assert resp.status_code == 422
        assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"


async def test_heartbeat_comments(
    stream_factory: StreamFactory, gateway_factory: GatewayFactory, unique: str
) -> None:
    h = await stream_factory(heartbeat_s=0.05)
    gw = await gateway_factory(h)
    key, path, _ = route(0, unique)
    await open_buffer(h, key)
    comments: list[str] = []
    async with gw.client.stream("GET", path) as resp:
        async with asyncio.timeout(5):
            async for line in resp.aiter_lines():
                if line.startswith(":"):
                    comments.append(line)
                if len(comments) >= 2:
                    break
    assert all(c.startswith(": ping") for c in comments)


async def test_rpc_failure_mid_stream_becomes_error_event(
    stream_factory: StreamFactory, gateway_factory: GatewayFactory, unique: str
) -> None:
    h = await stream_factory(idle_timeout_ms=200)
    gw = await gateway_factory(h)
    key, path, _ = route(0, unique)
    await open_buffer(h, key, n=1)
    async with aconnect_sse(gw.client, "GET", path) as source:
        got = [(sse.id, json.loads(sse.data)) async for sse in source.aiter_sse()]
    assert [d["type"] for _, d in got] == ["reasoning-delta", "error"]
    assert got[-1][1]["code"] == "idle_timeout"
    assert got[-1][0] == got[0][0]  # it carries no id: the resume point stays at the last offset


async def test_invalid_id_is_a_json_422(gw: Gateway) -> None:
    resp = await gw.client.get("/api/subagents/" + "x" * 201 + "/stream")
    assert resp.status_code == 422
    assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"
