"""The JSON bound at every entry of the gateway (issue 39, point 4; libs/jsonbound.py), on both backend
pairs: deep JSON, huge integers, numbers that are not finite and strings PostgreSQL refuses get a 422
with the JSON error body over HTTP, an error message over WebSocket (the socket stays open, a line is
logged) and a JSON-RPC error of the specification over A2A, never a 500, a closed socket, a task left
behind or Python's own words. Hypothesis drives the A2A JSON-RPC surface and WebSocket messages."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets
from a2a.types import a2a_pb2 as a2a
from a2a.utils.constants import TransportProtocol
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentmesh.libs import identity
from agentmesh.libs.jsonbound import MAX_DEPTH
from agentmesh.trace.v1 import task_service_pb2 as tks
from tests.e2e.a2a.clients import sdk_client, text_message
from tests.mesh import BACKENDS, Mesh, chat

CATALOG = Path(__file__).parents[2] / "e2e" / "a2a" / "catalog.yaml"
pytestmark = pytest.mark.mesh(
    backends=BACKENDS, catalog=CATALOG, rules={"rules": [], "default": {"text": "ok"}}, user="bounds"
)
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPEC_CODES = {-32700, -32600, -32601, -32602, -32603} | set(range(-32099, -32000 + 1))
# What Python says of itself, which no answer may carry.
INTERNALS = ("Traceback", "recursion", "int_max_str_digits", "sys.", "float infinity", "ipv4:", "ipv6:")


def nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


def nested_text(levels: int) -> str:
    return '{"a":' * levels + "1" + "}" * levels


async def trace_of(mesh: Mesh) -> str:
    return str((await chat(mesh, "general", "hello"))[0]["traceId"])


def no_internals(text: str) -> None:
    assert not any(word in text for word in INTERNALS), text[:500]


# ---- HTTP ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("metadata", "where"),
    [
        ('{"deep": ' + nested_text(100) + "}", "nested deeper than 32 levels"),
        ('{"n": NaN}', "NaN is not a JSON number"),
        ('{"n": Infinity}', "Infinity is not a JSON number"),
        ('{"n": 1e400}', "the number 1e400 is out of range"),
        ('{"n": ' + "9" * 5000 + "}", "an integer has more than 20 digits"),
        ('{"s": "a\\u0000b"}', "body.messages[0].metadata.s: must not contain U+0000"),
        ('{"s": "\\ud800"}', "body.messages[0].metadata.s: holds a lone surrogate"),
    ],
)
async def test_an_append_beyond_the_json_bound_is_a_422(mesh: Mesh, metadata: str, where: str) -> None:
    """The issue's probe: `metadata` nested 100 levels was a 500 (a traceback of ~480 lines)."""
    trace = await trace_of(mesh)
    body = '{"messages": [{"role": "user", "content": "x", "metadata": ' + metadata + "}]}"
    async with mesh.http() as http:
        r = await http.post(
            f"/api/traces/{trace}/messages", content=body, headers={"content-type": "application/json"}
        )
        assert r.status_code == 422, r.text[:300]
        error = r.json()["error"]
        assert error["reason"] == "INVALID_ARGUMENT" and where in error["message"], error
        no_internals(error["message"])
        listed = (await http.get(f"/api/traces/{trace}/messages")).json()["messages"]
    assert [m["content"] for m in listed] == ["hello", "ok"]  # nothing stored


async def test_json_within_the_bound_is_stored(mesh: Mesh) -> None:
    trace = await trace_of(mesh)
    metadata = {"deep": nested(MAX_DEPTH - 5), "n": 2**63, "f": 1.5e300}
    async with mesh.http() as http:
        r = await http.post(
            f"/api/traces/{trace}/messages",
            json={"messages": [{"role": "user", "content": "x", "metadata": metadata}]},
        )
    assert r.status_code == 200, r.text[:300]
    assert r.json()["messages"][0]["metadata"]["f"] == 1.5e300


async def test_nul_in_run_input_is_a_422_on_both_backends(mesh: Mesh) -> None:
    """It was a 500 on PostgreSQL and a 200 on SQLite."""
    trace = await trace_of(mesh)
    async with mesh.http() as http:
        r = await http.post(f"/api/traces/{trace}/run", json={"input": "hi\x00there"})
        assert r.status_code == 422, r.text[:300]
        assert r.json()["error"]["message"] == "invalid request: body.input: must not contain U+0000"
        listed = (await http.get(f"/api/traces/{trace}/messages")).json()["messages"]
    assert len(listed) == 2


# ---- WebSocket ----------------------------------------------------------------------------------------


async def test_a_websocket_message_nested_990_levels_gets_an_error_and_a_log_line(
    mesh: Mesh, caplog: pytest.LogCaptureFixture
) -> None:
    """It closed the socket with 1006, with nothing logged."""
    url = f"ws://127.0.0.1:{mesh.gateway.port}/api/ws?apiKey={mesh.api_key}"  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, logger="agentmesh.gateway.routes.chat"):
        async with websockets.connect(url) as ws:
            for frame in ("[" * 990 + "]" * 990, nested_text(990), '{"type": "chat", "x": NaN}'):
                await ws.send(frame)
                answer = json.loads(await asyncio.wait_for(ws.recv(), 10))
                assert answer["type"] == "error" and answer["code"] == "invalid_argument", answer
                assert answer["status"] == 422
            await ws.send(json.dumps({"type": "chat", "agent": "general", "message": "still here"}))
            seen: list[dict[str, Any]] = []
            while not seen or seen[-1]["type"] not in ("finish", "error"):
                seen.append(json.loads(await asyncio.wait_for(ws.recv(), 10)))
    assert seen[-1]["type"] == "finish", seen
    refused = [r for r in caplog.records if r.getMessage().startswith("websocket message refused")]
    assert len(refused) == 3


# ---- A2A JSON-RPC ---------------------------------------------------------------------------------------


def rpc(method: str, params: Any, request_id: Any = 1) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "method": method, "params": params})


def send(text: str, **metadata: Any) -> dict[str, Any]:
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": text}], "metadata": metadata}
    return {"message": message}


async def a2a_post(http: httpx.AsyncClient, body: str | bytes) -> dict[str, Any]:
    r = await http.post(
        "/a2a/echo", content=body, headers={"content-type": "application/json", "A2A-Version": "1.0"}
    )
    assert r.status_code == 200, r.text[:300]
    no_internals(r.text)
    return dict(r.json())


async def task_count(mesh: Mesh) -> int:
    assert mesh.clients is not None
    with identity.acting_as(mesh.user):
        resp = await mesh.clients.tasks.ListA2ATasks(
            tks.ListA2ATasksRequest(callee_agent="echo", page_size=100)
        )
    return len(resp.tasks)


@pytest.mark.parametrize(
    ("body", "code", "request_id"),
    [
        pytest.param(
            b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "\xff"}}',
            -32700,
            None,
            id="not-utf8",
        ),
        pytest.param(b'{"jsonrpc": "2.0", "id": 1,', -32700, None, id="not-json"),
        pytest.param(("[" * 5000 + "]" * 5000).encode(), -32600, None, id="deep-array"),
        pytest.param(
            ('{"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": ' + nested_text(900) + "}").encode(),
            -32602,
            7,
            id="deep-params",
        ),
        pytest.param(
            ('{"jsonrpc": "2.0", "id": ' + "9" * 5000 + ', "method": "GetTask", "params": {}}').encode(),
            -32600,
            None,
            id="5000-digit-id",
        ),
        pytest.param(
            (
                '{"jsonrpc": "2.0", "id": 3, "method": "ListTasks", "params": {"pageSize": '
                + "9" * 5000
                + "}}"
            ).encode(),
            -32602,
            3,
            id="5000-digit-param",
        ),
        pytest.param(rpc("ListTasks", {"pageToken": "not-a-token"}).encode(), -32602, 1, id="bad-page-token"),
        pytest.param(rpc("SendMessage", send("a\x00b")).encode(), -32602, 1, id="nul-text"),
    ],
)
async def test_a2a_input_gets_a_json_rpc_error_of_the_specification(
    mesh: Mesh, body: bytes, code: int, request_id: Any
) -> None:
    """Each was -32603 carrying Python's own words ("maximum recursion depth exceeded", "Exceeds the limit
    (4300 digits)", "invalid page_token" as an internal error), or a failed task for NUL."""
    before = await task_count(mesh)
    async with mesh.http() as http:
        answer = await a2a_post(http, body)
    assert answer["jsonrpc"] == "2.0" and answer["id"] == request_id, answer
    assert answer["error"]["code"] == code, answer
    assert await task_count(mesh) == before


@pytest.mark.parametrize("depth", ["NaN", "Infinity", "-Infinity", "1e400"])
async def test_a2a_depth_that_is_not_finite_is_invalid_params_and_starts_no_task(
    mesh: Mesh, depth: str
) -> None:
    """It was -32603 "cannot convert float infinity to integer" with a task left SUBMITTED for ~45 s."""
    before = await task_count(mesh)
    body = rpc("SendMessage", send("hi", depth="@@")).replace('"@@"', depth)
    async with mesh.http() as http:
        answer = await a2a_post(http, body)
    assert answer["error"]["code"] == -32602, answer
    assert await task_count(mesh) == before


async def test_an_a2a_message_within_the_bound_is_served(mesh: Mesh) -> None:
    async with mesh.http() as http:
        answer = await a2a_post(http, rpc("SendMessage", send("hello", depth=1, note=nested(10))))
    assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", answer


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)
methods = st.sampled_from(
    [
        "SendMessage",
        "GetTask",
        "ListTasks",
        "CancelTask",
        "SubscribeToTask",
        "GetExtendedAgentCard",
        "message/send",
        "tasks/get",
        "tasks/cancel",
        "nope",
    ]
)
ids = st.one_of(st.none(), st.integers(min_value=-(2**40), max_value=2**40), st.text(max_size=10))
params = st.one_of(
    json_values,
    st.fixed_dictionaries({"id": st.text(max_size=40)}),
    st.fixed_dictionaries({"pageToken": st.text(max_size=40), "pageSize": st.integers(-5, 10**6)}),
    st.fixed_dictionaries(
        {
            "message": st.fixed_dictionaries(
                {
                    "messageId": st.text(max_size=10),
                    "role": st.sampled_from(["ROLE_USER", "ROLE_AGENT", "x"]),
                    "parts": st.lists(st.fixed_dictionaries({"text": st.text(max_size=20)}), max_size=2),
                    "metadata": st.dictionaries(st.sampled_from(["depth", "x"]), json_values, max_size=2),
                }
            )
        }
    ),
)
requests = st.one_of(
    st.builds(lambda m, p, i: rpc(m, p, i), methods, params, ids),
    st.builds(
        lambda m, p: json.dumps({"jsonrpc": "2.0", "method": m, "params": p}).replace(": 1.5", ": NaN"),
        methods,
        params,
    ),
    json_values.map(json.dumps),
    st.binary(max_size=60).map(lambda b: b.decode("latin-1")),
)


async def test_hypothesis_on_the_a2a_json_rpc_surface(mesh: Mesh) -> None:
    """Whatever the body: HTTP 200 with a JSON-RPC 2.0 answer, an error of the specification's codes
    (a result only for a request that made sense), without Python's words."""

    def run() -> None:
        headers = {"Authorization": f"Bearer {mesh.api_key}", "A2A-Version": "1.0"}
        with httpx.Client(base_url=mesh.url, headers=headers, timeout=30) as http:

            @EXAMPLES
            @given(requests)
            def one(body: str) -> None:
                r = http.post(
                    "/a2a/echo",
                    content=body.encode("utf-8", "surrogatepass"),
                    headers={"content-type": "application/json"},
                )
                assert r.status_code == 200, (body[:200], r.status_code, r.text[:300])
                no_internals(r.text)
                if r.headers["content-type"].startswith("text/event-stream"):
                    return
                answer = r.json()
                assert answer["jsonrpc"] == "2.0"
                if "error" in answer:
                    assert answer["error"]["code"] in SPEC_CODES, answer

            one()

    await asyncio.to_thread(run)


async def test_hypothesis_on_websocket_messages(mesh: Mesh) -> None:
    """Whatever a message holds: an error message (or a turn's events, or a cancel result) and an open
    socket, never a close."""
    url = f"ws://127.0.0.1:{mesh.gateway.port}/api/ws?apiKey={mesh.api_key}"  # type: ignore[union-attr]
    frames = st.one_of(
        json_values.map(json.dumps),
        st.text(max_size=50),
        st.integers(1, 2000).map(lambda n: "[" * n + "]" * n),
        st.builds(
            lambda p: json.dumps({"type": "cancel", **(p if isinstance(p, dict) else {})}), json_values
        ),
        st.builds(lambda p: json.dumps({"type": "chat", "agent": "x", "message": p}), json_values),
    )

    def run() -> None:
        from websockets.sync.client import connect

        with connect(url) as ws:

            @EXAMPLES
            @given(frames)
            def one(frame: str) -> None:
                ws.send(frame)
                answer = json.loads(ws.recv(timeout=10))
                assert answer["type"] in ("error", "cancel-result", "start"), answer
                while answer["type"] not in ("error", "cancel-result", "finish"):
                    answer = json.loads(ws.recv(timeout=10))
                no_internals(json.dumps(answer))

            one()

    await asyncio.to_thread(run)


@pytest.mark.parametrize(
    "message",
    [
        pytest.param(text_message("a\x00b"), id="nul-text"),
        pytest.param(text_message("hi", depth=math.nan), id="nan-depth"),
        pytest.param(text_message("hi", depth=math.inf), id="inf-depth"),
    ],
)
async def test_the_a2a_grpc_binding_refuses_alike(mesh: Mesh, message: a2a.SendMessageRequest) -> None:
    """The gRPC binding shares the check: invalid params (INVALID_ARGUMENT), no task, no internals."""
    before = await task_count(mesh)
    client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key, TransportProtocol.GRPC)
    try:
        with pytest.raises(Exception) as refused:
            _ = [r async for r in client.send_message(message)]
    finally:
        await client.close()
    text = f"{refused.value!r} {refused.value}"
    assert "InvalidParams" in text or "INVALID_ARGUMENT" in text or "nvalid params" in text, text[:500]
    no_internals(text)
    assert await task_count(mesh) == before
