"""The gateway's resumable SSE routes through a real uvicorn on a loopback port (real disconnects),
over a real stream service (memory and Redis) and a real trace service for Bearer auth.

The fixtures live in tests/integration/stream/conftest.py and are imported here (not from a
tests/integration/gateway/conftest.py, which other gateway suites own)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from httpx_sse import aconnect_sse

from agentmesh.libs import events
from agentmesh.libs.rpc import ServiceServer
from agentmesh.services.stream.memory import MemoryBackend
from agentmesh.services.stream.server import build
from tests.integration.stream.conftest import (  # noqa: F401 - fixtures used by name
    Gateway,
    GatewayFactory,
    StreamFactory,
    StreamHarness,
    append,
    auth_trace,
    backend_kind,
    close,
    create,
    gateway_factory,
    stream,
    stream_factory,
)
from tests.mesh import wait_until

ROUTES = [
    ("trace:{}", "/api/sessions/{}/stream", {}),
    ("a2a:{}", "/api/agents/a2a/stream", {"taskId": "{}"}),
    ("subagent:{}", "/api/subagents/{}/stream", {}),
]
ROUTE_IDS = ["session", "a2a", "subagent"]


def route(index: int, ident: str) -> tuple[str, str, dict[str, str]]:
    """(stream key, path, query) of one SSE route for the resource `ident`."""
    key, path, params = ROUTES[index]
    return key.format(ident), path.format(ident), {k: v.format(ident) for k, v in params.items()}


async def open_buffer(h: StreamHarness, key: str, owner: str = "alice", n: int = 0) -> list[str]:
    await create(h, key, owner=owner)
    return await push(h, key, n)


async def push(h: StreamHarness, key: str, n: int, start: int = 0) -> list[str]:
    if not n:
        return []
    return await append(
        h, key, [events.reasoning_delta(f"r{i}") for i in range(start, start + n)]
    )  # not coalesced


async def finish(h: StreamHarness, key: str) -> str:
    return (await close(h, key)).offset


@pytest.fixture
async def gw(stream: StreamHarness, gateway_factory: GatewayFactory) -> Gateway:  # noqa: F811
    return await gateway_factory(stream)


@pytest.mark.parametrize("which", [0, 1, 2], ids=ROUTE_IDS)
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
            assert source.response.status_code == 200
            return [sse.id async for sse in source.aiter_sse()]

    by_header = await rest(headers={"Last-Event-ID": first[-1]})
    by_query = await rest(params={"lastEventId": first[-1]})
    assert first + by_header == offsets  # no gap, no duplicate
    assert by_query == by_header
    assert await rest(params={"lastEventId": f"  {first[-1]} "}) == by_header  # surrounding blanks ignored
    assert await rest(headers={"Last-Event-ID": offsets[-1]}) == []  # nothing after the terminal event


async def test_disconnect_ends_server_subscription(gw: Gateway, unique: str) -> None:
    key, path, _ = route(2, unique)
    await open_buffer(gw.stream, key)
    async with gw.client.stream("GET", path) as resp:
        assert resp.status_code == 200
        await wait_until(lambda: gw.stream.backend.subscribers == 1, 5, "the subscription to start")
    await wait_until(lambda: gw.stream.backend.subscribers == 0, 5, "the subscription to end on disconnect")


@pytest.mark.parametrize("which", [0, 1, 2], ids=ROUTE_IDS)
async def test_foreign_reader_is_not_found(gw: Gateway, unique: str, which: int) -> None:
    # (The no-buffer answer needs the trace service to prove ownership: agent_runtime/test_agent_invoke.py.)
    key, path, params = route(which, unique)
    await open_buffer(gw.stream, key, owner="alice", n=1)
    bob = {"Authorization": f"Bearer {gw.keys['bob']}"}
    resp = await gw.client.get(path, params=params, headers=bob)
    assert resp.status_code == 404
    assert resp.json()["error"]["reason"] == "NOT_FOUND"
    _, missing_path, missing_params = route(which, unique + "-none")
    missing = await gw.client.get(missing_path, params=missing_params, headers=bob)
    assert (missing.status_code, missing.json()["error"]["reason"]) == (404, "NOT_FOUND")  # alike
    assert gw.stream.backend.subscribers == 0


@pytest.mark.parametrize(
    "auth", [None, "Bearer am_wrong", "Basic x"], ids=["none", "unknown-key", "not-bearer"]
)
async def test_stream_needs_a_valid_key(gw: Gateway, unique: str, auth: str | None) -> None:
    key, path, _ = route(0, unique)
    await open_buffer(gw.stream, key, n=1)
    headers = {"Authorization": auth} if auth else {}
    gw.client.headers.pop("Authorization")
    resp = await gw.client.get(path, headers=headers)
    assert resp.status_code == 401
    assert resp.json()["error"]["reason"] == "UNAUTHENTICATED"
    assert gw.stream.backend.subscribers == 0


async def test_a2a_requires_task_id(gw: Gateway) -> None:
    for params in ({}, {"taskId": ""}):
        resp = await gw.client.get("/api/agents/a2a/stream", params=params)
        assert resp.status_code == 422
        assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"


async def test_heartbeat_comments(
    stream_factory: StreamFactory,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
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
    stream_factory: StreamFactory,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
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


@pytest.mark.parametrize(
    "path",
    [
        "/api/subagents/" + "x" * 65 + "/stream",
        "/api/subagents/" + "x" * 201 + "/stream",
        "/api/sessions/a:b/stream",
        "/api/sessions/.hidden/stream",
    ],
    ids=["65-chars", "201-chars", "colon", "leading-dot"],
)
async def test_invalid_id_is_a_json_422(gw: Gateway, path: str) -> None:
    resp = await gw.client.get(path)
    assert resp.status_code == 422
    assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"


async def test_invalid_task_id_is_a_json_422(gw: Gateway) -> None:
    resp = await gw.client.get("/api/agents/a2a/stream", params={"taskId": "a:b"})
    assert resp.status_code == 422
    assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"


HOSTILE_OFFSETS = {
    "5000-digits": "9" * 5000,
    "superscript-two": "\u00b2",
    "three-parts": "1-2-3",
    "21-digits": "9" * 21,
    "above-2^64": "9" * 20,
    "seq-above-2^64": "1-" + "9" * 20,
    "letters": "abc",
    "empty-seq": "1-",
}


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
@pytest.mark.parametrize("how", ["header", "query"])
@pytest.mark.parametrize("offset", list(HOSTILE_OFFSETS.values()), ids=list(HOSTILE_OFFSETS))
async def test_hostile_resume_offset_is_a_json_422(
    gw: Gateway, unique: str, offset: str, how: str, closed: bool
) -> None:
    key, path, _ = route(0, unique)
    await open_buffer(gw.stream, key, n=1)
    if closed:
        await finish(gw.stream, key)
    if how == "header":  # UTF-8 bytes on the wire (a header is read as Latin-1: still no ASCII digits)
        kw: dict[str, Any] = {"headers": {"Last-Event-ID": offset.encode()}}
    else:
        kw = {"params": {"lastEventId": offset}}
    async with gw.client.stream("GET", path, **kw) as resp:
        body = await resp.aread()
    assert resp.status_code == 422, body[:300]
    assert resp.headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    assert (error["code"], error["reason"]) == (422, "INVALID_ARGUMENT")
    assert "offset" in error["message"] and len(error["message"]) < 200  # the offset is not echoed whole
    assert gw.stream.backend.subscribers == 0


async def test_percent_encoded_unicode_digit_is_a_json_422(gw: Gateway, unique: str) -> None:
    key, path, _ = route(0, unique)
    await open_buffer(gw.stream, key, n=1)
    resp = await gw.client.get(f"{path}?lastEventId=%C2%B2")  # "²": a digit to str.isdigit()
    assert resp.status_code == 422
    assert resp.json()["error"]["reason"] == "INVALID_ARGUMENT"


U64 = 2**64 - 1


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
async def test_offset_a_backend_refuses_is_an_invalid_argument_event(
    gw: Gateway,
    unique: str,
    closed: bool,
) -> None:
    """The largest Redis entry id has the shape of an offset, so the gateway subscribes; both backends
    refuse it (memory: not digits only; Redis: nothing can follow it), and the SSE ends with an `error`
    event invalid_argument, never `internal`."""
    key, path, _ = route(0, unique)
    await open_buffer(gw.stream, key, n=1)
    if closed:
        await finish(gw.stream, key)
    async with aconnect_sse(gw.client, "GET", path, headers={"Last-Event-ID": f"{U64}-{U64}"}) as source:
        assert source.response.status_code == 200
        got = [(sse.id, json.loads(sse.data)) async for sse in source.aiter_sse()]
    assert [(i, d["type"], d["code"]) for i, d in got] == [("", "error", "invalid_argument")]
    assert "offset" in got[0][1]["message"]


async def test_largest_offset_replays_nothing(gw: Gateway, unique: str) -> None:
    key, path, _ = route(0, unique)
    await open_buffer(gw.stream, key, n=1)
    await finish(gw.stream, key)
    async with aconnect_sse(gw.client, "GET", path, headers={"Last-Event-ID": str(U64)}) as source:
        assert source.response.status_code == 200
        assert [sse async for sse in source.aiter_sse()] == []  # closed, and nothing after that offset


async def test_a_buffer_lost_with_its_stream_service_ends_the_reader_interrupted(
    stream_factory: StreamFactory,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
    signer: Any,
) -> None:
    """The in-memory stream service holding the buffer stops and comes back empty at its address: the
    reader's resubscription finds no buffer, and its stream ends `interrupted` (the live stream was
    lost), not `not_found` (which reads as a wrong id)."""
    h = await stream_factory()
    if not isinstance(h.backend, MemoryBackend):
        pytest.skip("a Redis buffer outlives its stream service")
    gw = await gateway_factory(h)
    key, path, _ = route(0, unique)
    await open_buffer(h, key, n=1)
    got: list[dict[str, Any]] = []
    again: ServiceServer | None = None
    try:
        async with aconnect_sse(gw.client, "GET", path) as source:
            async for sse in source.aiter_sse():
                got.append(json.loads(sse.data))
                if len(got) == 1:  # following live: the service goes, another comes up empty
                    await h.server.stop(1.0)
                    backend = MemoryBackend(h.settings.stream)
                    again = await build(h.settings, h.server.target, backend, signer)
                    await again.start()
    finally:
        if again is not None:
            await again.stop(1.0)
    assert [d["type"] for d in got] == ["reasoning-delta", "error"]
    assert got[-1]["code"] == "interrupted", got[-1]


async def test_a_resume_into_a_newer_buffer_of_the_key_ends_interrupted(gw: Gateway, unique: str) -> None:
    """`Last-Event-ID` from a buffer the next turn's buffer of the key has replaced (memory or Redis): the
    reader's stream ends `interrupted`, with none of the newer events."""
    key, path, _ = route(0, unique)
    (old,) = await open_buffer(gw.stream, key, n=1)
    await finish(gw.stream, key)
    await open_buffer(gw.stream, key, n=2)  # the next turn's buffer replaces the closed one
    async with aconnect_sse(gw.client, "GET", path, headers={"Last-Event-ID": old}) as source:
        got = [json.loads(sse.data) async for sse in source.aiter_sse()]
    assert [d["type"] for d in got] == ["error"]
    assert got[0]["code"] == "interrupted", got[0]
