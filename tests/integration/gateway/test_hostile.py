"""Hostile input at the gateway of a real mesh (issue 11, points 3 and 5): every answer is a clear 4xx
with the JSON error body `{"error": {code, reason, message}}`, never a 500, a hang or a traceback, and
no socket stays open. Raw sockets where the HTTP client would not send what an attacker sends."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
import websockets

from agentmesh.gateway import errors
from agentmesh.gateway.app import create_app
from agentmesh.gateway.limits import (
    MAX_BODY_BYTES,
    MAX_HEAD_BYTES,
    MAX_HEADERS,
    MAX_LINE_BYTES,
    BodyLimitMiddleware,
)
from agentmesh.gateway.server import http_limits
from agentmesh.libs import embedded_http
from agentmesh.libs.config import MeshSettings
from tests.mesh import TEST_CATALOG, Mesh, chat

WS_UPGRADE = (
    "Host: gateway\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
)


def error(status: int, reason: str, message: str) -> dict[str, Any]:
    return {"error": {"code": status, "reason": reason, "message": message}}


pytestmark = pytest.mark.mesh(catalog=TEST_CATALOG, rules={"rules": []})


# ---- raw sockets ---------------------------------------------------------------------------------------


class Raw:
    """One TCP connection to a gateway: what it answered, and whether it closed, within a deadline."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Raw:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def until_closed(self, timeout: float) -> bytes:
        """Everything the server sent up to its end of the connection; fails if it stays open."""
        try:
            async with asyncio.timeout(timeout):
                return await self.reader.read()
        except TimeoutError:
            raise AssertionError(f"the gateway left the socket open for {timeout}s") from None
        finally:
            self.writer.close()


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers with lower-case names, body) of one HTTP/1.1 response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


async def exchange(port: int, request: bytes, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Sends `request` on a fresh connection and reads the answer until the gateway closes it."""
    conn = await Raw.open(port)
    await conn.send(request)
    return parse(await conn.until_closed(timeout))


def request_line_of(size: int, path: str = "/api/sessions") -> str:
    """`GET <path>?x=AAA… HTTP/1.1\\r\\n`, exactly `size` bytes with its CRLF."""
    fixed = len(f"GET {path}?x= HTTP/1.1\r\n")
    return f"GET {path}?x={'A' * (size - fixed)} HTTP/1.1\r\n"


# ---- the request head --------------------------------------------------------------------------------


async def test_fifty_websocket_upgrades_with_a_9kb_request_line_get_the_json_414_and_closed_sockets(
    mesh: Mesh,
) -> None:
    """The issue's probe: `GET /api/ws?apiKey=am_<9,000 x A>`; with uvicorn's websockets-sansio this
    answered nothing and 50 such sockets stayed open after 150 s; then the `websockets` parser answered
    400 text/plain ("line too long"), not the documented 414 JSON (issue 39, point 5)."""
    port = mesh.gateway.port  # type: ignore[union-attr]
    upgrade = f"GET /api/ws?apiKey=am_{'A' * 9000} HTTP/1.1\r\n{WS_UPGRADE}\r\n".encode()
    started = time.monotonic()
    answers = await asyncio.gather(*(exchange(port, upgrade, timeout=10) for _ in range(50)))
    elapsed = time.monotonic() - started
    assert [status for status, _, _ in answers] == [414] * 50
    for _, headers, body in answers:
        assert (headers["content-type"], headers["connection"]) == ("application/json", "close")
        assert json.loads(body) == error(414, "RESOURCE_EXHAUSTED", "request line over 8192 bytes")
    assert elapsed < 10  # every socket closed by the gateway (exchange fails on one left open)


async def test_a_websocket_upgrade_beyond_the_parsers_own_limits_gets_the_json_431(mesh: Mesh) -> None:
    """A header line over 8 KiB, or more headers than the `websockets` parser takes (128): the
    documented 431 JSON, not its 400 text/plain."""
    port = mesh.gateway.port  # type: ignore[union-attr]
    long_line = f"X-Long: {'v' * MAX_LINE_BYTES}\r\n"
    many = "".join(f"X-H{i}: v\r\n" for i in range(150))
    for extra, message in (
        (long_line, f"request header 'x-long' over {MAX_LINE_BYTES} bytes"),
        (many, f"more than {MAX_HEADERS} request headers"),
    ):
        status, headers, body = await exchange(
            port, f"GET /api/ws HTTP/1.1\r\n{WS_UPGRADE}{extra}\r\n".encode()
        )
        assert (status, headers["content-type"]) == (431, "application/json"), body[:200]
        assert json.loads(body) == error(431, "RESOURCE_EXHAUSTED", message)


async def test_request_line_up_to_8_kib_is_served_and_beyond_is_414(mesh: Mesh) -> None:
    port = mesh.gateway.port  # type: ignore[union-attr]
    close = "Host: gateway\r\nConnection: close\r\n\r\n"
    status, _, body = await exchange(port, (request_line_of(MAX_LINE_BYTES) + close).encode())
    assert status == 401 and json.loads(body)["error"]["reason"] == "UNAUTHENTICATED"  # read, then refused
    for size in (MAX_LINE_BYTES + 1, 100_000):
        keep_alive = "Host: gateway\r\n\r\n"  # the gateway closes it all the same
        status, headers, body = await exchange(port, (request_line_of(size) + keep_alive).encode())
        assert status == 414, size
        assert headers["connection"] == "close" and headers["content-type"] == "application/json"
        assert json.loads(body) == error(414, "RESOURCE_EXHAUSTED", "request line over 8192 bytes")


async def test_headers_over_the_limits_are_431(mesh: Mesh) -> None:
    port = mesh.gateway.port  # type: ignore[union-attr]
    line = "GET /healthz HTTP/1.1\r\nHost: gateway\r\n"
    many = "".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADERS - 1))  # with Host: exactly the limit
    status, _, body = await exchange(port, f"{line}{many}Connection: close\r\n\r\n".encode())
    assert (status, json.loads(body)) == (
        431,
        error(431, "RESOURCE_EXHAUSTED", "more than 100 request headers"),
    )
    status, _, body = await exchange(
        port, f"{line}{many[: -len('X-H98: v') - 2]}Connection: close\r\n\r\n".encode()
    )
    assert (status, json.loads(body)) == (200, {"status": "ok"})  # 99 headers and Connection

    long_value = "v" * (MAX_LINE_BYTES - len("X-Long: \r\n") + 1)
    status, headers, body = await exchange(port, f"{line}X-Long: {long_value}\r\n\r\n".encode())
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body) == error(431, "RESOURCE_EXHAUSTED", "request header 'x-long' over 8192 bytes")

    # Lines within the limit, but more than 64 KiB in all.
    big = "".join(f"X-B{i}: {'v' * 8000}\r\n" for i in range(MAX_HEAD_BYTES // 8000 + 1))
    status, _, body = await exchange(port, f"{line}{big}\r\n".encode())
    assert (status, json.loads(body)) == (
        431,
        error(431, "RESOURCE_EXHAUSTED", "request headers over 65536 bytes"),
    )


async def test_an_incomplete_head_over_64_kib_is_400_and_closed(mesh: Mesh) -> None:
    """uvicorn's h11 parser drops a head that grows past MAX_HEAD_BYTES before it ends (plain text: the
    request never reached the app)."""
    conn = await Raw.open(mesh.gateway.port)  # type: ignore[union-attr]
    await conn.send(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n")
    for i in range(MAX_HEAD_BYTES // 4000 + 2):  # never the blank line that ends a head
        await conn.send(f"X-P{i}: {'v' * 4000}\r\n".encode())
    status, headers, body = parse(await conn.until_closed(5))
    assert (status, headers["connection"], body) == (400, "close", b"Invalid HTTP request received.")


async def test_a_websocket_upgrade_over_the_header_limits_gets_the_json_431(mesh: Mesh) -> None:
    """Under the `websockets` parser's own limits (128 headers, 8 KiB lines) but over the gateway's:
    the same JSON answer as a plain request, as the handshake's HTTP response."""
    port = mesh.gateway.port  # type: ignore[union-attr]
    many = "".join(f"X-H{i}: v\r\n" for i in range(MAX_HEADERS))
    status, headers, body = await exchange(port, f"GET /api/ws HTTP/1.1\r\n{WS_UPGRADE}{many}\r\n".encode())
    assert (status, headers["content-type"]) == (431, "application/json")
    assert json.loads(body) == error(431, "RESOURCE_EXHAUSTED", "more than 100 request headers")


async def test_a_socket_that_never_sends_a_whole_head_is_closed(mesh: Mesh) -> None:
    """A second gateway on the same mesh with a head deadline of 0.5 s (10 s in production): a silent
    socket, and one that sends part of a head and stops, are closed; the second hears why (408)."""
    server = await embedded_http.serve(create_app(mesh.settings), **http_limits(head_timeout_s=0.5))
    try:
        started = time.monotonic()
        silent = [await Raw.open(server.port) for _ in range(50)]
        partial = await Raw.open(server.port)
        await partial.send(b"GET /api/sessions HTTP/1.1\r\nHost: gateway\r\nAuthori")
        answers = await asyncio.gather(*(conn.until_closed(5) for conn in silent))
        assert answers == [b""] * 50 and time.monotonic() - started < 5
        status, headers, body = parse(await partial.until_closed(5))
        assert (status, headers["connection"]) == (408, "close")
        assert json.loads(body) == error(408, "DEADLINE_EXCEEDED", "no complete request head within 0.5 s")

        # A served request: after its answer the deadline runs again for the next head.
        served = await Raw.open(server.port)
        await served.send(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\n\r\n")
        status, _, body = parse(await served.until_closed(5))
        assert (status, body) == (200, b'{"status":"ok"}')
    finally:
        await server.stop()


async def test_a_head_the_gateway_has_not_read_yet_is_not_the_clients_delay(mesh: Mesh) -> None:
    """The client sent its whole head, but the gateway did not read it before the head deadline (its
    loop saturated by a burst of connections: here, reading paused for a second): the deadline runs
    again instead of closing the connection, and the request is served."""
    from agentmesh.gateway.limits import HeadTimeoutProtocol

    class Busy(HeadTimeoutProtocol):
        head_timeout_s = 0.3

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            transport.pause_reading()
            self.loop.call_later(1.0, transport.resume_reading)

    server = await embedded_http.serve(create_app(mesh.settings), **{**http_limits(), "http": Busy})
    try:
        conn = await Raw.open(server.port)
        await conn.send(b"GET /healthz HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\n\r\n")
        status, _, body = parse(await conn.until_closed(5))
        assert (status, body) == (200, b'{"status":"ok"}')
    finally:
        await server.stop()


async def test_a_body_that_never_completes_is_408_and_closed(mesh: Mesh) -> None:
    """The gateway again, with a body deadline of 0.5 s (60 s in production) around it."""
    app = BodyLimitMiddleware(create_app(mesh.settings), timeout_s=0.5)
    server = await embedded_http.serve(app, **http_limits())
    try:
        conn = await Raw.open(server.port)
        body = json.dumps({"agent": "general", "message": "hello"}).encode()
        await conn.send(
            b"POST /api/chat HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {mesh.api_key}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        status, headers, answer = parse(await conn.until_closed(5))
        assert (status, headers["connection"]) == (408, "close")
        assert json.loads(answer) == error(408, "DEADLINE_EXCEEDED", "request body not complete within 0.5 s")
    finally:
        await server.stop()


# ---- WebSocket messages --------------------------------------------------------------------------------


async def test_websocket_messages_over_1_mib_close_the_socket_with_1009(mesh: Mesh) -> None:
    url = mesh.url.replace("http://", "ws://") + f"/api/ws?apiKey={mesh.api_key}"
    async with websockets.connect(url) as ws:
        await ws.send("x" * MAX_BODY_BYTES)  # at the limit: read, and answered (not JSON)
        reply = json.loads(await asyncio.wait_for(ws.recv(), 10))
        assert reply == {
            "type": "error",
            "code": "invalid_argument",
            "message": "messages must be JSON objects",
            "status": 422,
        }
        await ws.send("x" * (MAX_BODY_BYTES + 1))
        with pytest.raises(websockets.exceptions.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


# ---- JSON errors for what FastAPI and Starlette answer themselves ---------------------------------------


async def test_unknown_routes_and_methods(mesh: Mesh) -> None:
    async with mesh.http() as http:
        r = await http.get("/api/nope")
        assert (r.status_code, r.json()) == (404, error(404, "NOT_FOUND", "no route /api/nope"))
        r = await http.put("/api/sessions/abc")
        assert r.status_code == 405 and r.headers["allow"] == "GET, PATCH, DELETE"
        assert r.json() == error(
            405, "METHOD_NOT_ALLOWED", "PUT is not allowed here; allowed: GET, PATCH, DELETE"
        )
        r = await http.options("/api/sessions")  # two routes on one path: Allow names both
        assert r.status_code == 405 and r.headers["allow"] == "GET, DELETE"
        assert r.json()["error"]["reason"] == "METHOD_NOT_ALLOWED"
        r = await http.get("/api/chat")
        assert (r.status_code, r.headers["allow"]) == (405, "POST")
        r = await http.post("/a2a/general/.well-known/agent-card.json")  # an A2A path (not in the document)
        assert (r.status_code, r.headers["allow"]) == (405, "GET, HEAD")
        assert r.json()["error"]["reason"] == "METHOD_NOT_ALLOWED"
    assert "METHOD_NOT_ALLOWED" in errors.reasons_for(405) and "NOT_FOUND" not in errors.reasons_for(405)


async def test_every_401_says_bearer(mesh: Mesh) -> None:
    """A missing, malformed or unknown key, on the API, the WebSocket's HTTP side and A2A: each 401
    carries `WWW-Authenticate: Bearer` (RFC 9110: a 401 must name its scheme)."""
    async with mesh.http(api_key="") as anonymous, mesh.http(api_key="am_unknown") as wrong:
        answers = [
            await anonymous.get("/api/sessions"),
            await anonymous.post("/api/chat", json={"agent": "general", "message": "hi"}),
            await anonymous.get("/api/sessions", headers={"Authorization": "Basic dXNlcjpwdw=="}),
            await wrong.get("/api/agents"),
            await wrong.get("/api/traces/abc"),
            await wrong.post("/a2a/general", json={"jsonrpc": "2.0", "id": 1, "method": "GetTask"}),
        ]
    for r in answers:
        assert r.status_code == 401, (r.request.url, r.status_code, r.text)
        assert r.headers["www-authenticate"].startswith("Bearer"), r.request.url
        assert r.json()["error"]["reason"] == "UNAUTHENTICATED"
    document = errors.responses(401)[401]
    assert document["headers"]["WWW-Authenticate"]["required"] is True


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b'{"agent": "general", "message": "\xff\xfe"}', "request body is not valid UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "invalid request: body: nested deeper than 32 levels"),
        (
            b'{"title": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_001,
            "invalid request: body: nested deeper than 32 levels",
        ),
    ],
    ids=["invalid-utf8", "nested-100000-arrays", "nested-100000-objects"],
)
@pytest.mark.parametrize("route", ["POST /api/chat", "PATCH /api/sessions/{id}"])
async def test_bodies_that_are_not_json_are_a_json_422(
    mesh: Mesh, body: bytes, message: str, route: str
) -> None:
    method, path = route.split(" ")
    async with mesh.http() as http:
        path = path.format(id="no-such-session")  # the body is read first
        r = await http.request(method, path, content=body, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (422, error(422, "INVALID_ARGUMENT", message))


async def test_malformed_json_is_a_json_422_with_where(mesh: Mesh) -> None:
    async with mesh.http() as http:
        r = await http.post("/api/chat", content=b'{"agent":', headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json() == {
        "error": {
            "code": 422,
            "reason": "INVALID_ARGUMENT",
            "message": "invalid request: body.9: JSON decode error",
            "details": [{"loc": ["body", 9], "msg": "JSON decode error"}],
        }
    }


async def test_an_unexpected_exception_is_a_json_500_without_a_traceback(tmp_path: Any) -> None:
    app = create_app(MeshSettings(data_dir=tmp_path))

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals /etc/passwd")

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        r = await http.get("/boom")
    assert (r.status_code, r.json()) == (500, error(500, "INTERNAL", "internal error"))


# ---- ids and resume offsets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "subagent_id",
    ["9223372036854775808", "18446744073709551616", "9" * 64, "-1", "1e400"],
)
async def test_big_and_odd_subagent_ids_are_404(mesh: Mesh, subagent_id: str) -> None:
    async with mesh.http() as http:
        r = await http.get(f"/api/subagents/{subagent_id}/stream")
    if subagent_id.startswith("-"):  # not an id: 422 before any call
        assert r.status_code == 422 and r.json()["error"]["reason"] == "INVALID_ARGUMENT"
        assert r.json()["error"]["message"].startswith(
            "invalid request: path.subagent_id: String should match"
        )
    else:
        assert (r.status_code, r.json()) == (
            404,
            error(404, "NOT_FOUND", f"no stream subagent:{subagent_id}"),
        )


async def test_ids_over_64_characters_are_422(mesh: Mesh) -> None:
    async with mesh.http() as http:
        for path in ("/api/subagents/{}/stream", "/api/sessions/{}", "/api/sessions/{}/stream"):
            r = await http.get(path.format("9" * 65))
            assert r.status_code == 422 and r.json()["error"]["reason"] == "INVALID_ARGUMENT", path
        r = await http.get("/api/agents/a2a/stream", params={"taskId": "9" * 65})
        assert r.status_code == 422


@pytest.mark.parametrize("how", ["header", "query"])
@pytest.mark.parametrize(
    ("offset", "shown"),
    # as the message shows it: quoted, and cut to 40 characters with "..." when longer
    [("9" * 5000, "'" + "9" * 36 + "..."), ("\u00b2", "'\u00b2'"), (f"{2**64}", f"'{2**64}'")],
    ids=["5000-digits", "superscript-two", "2^64"],
)
async def test_hostile_last_event_ids_are_422_on_a_live_session(
    mesh: Mesh, offset: str, shown: str, how: str
) -> None:
    events = await chat(mesh, "general", "hello")
    session = events[0]["traceId"]
    kw: dict[str, Any] = (
        {"headers": {"Last-Event-ID": offset.encode()}}
        if how == "header"
        else {"params": {"lastEventId": offset}}
    )
    async with mesh.http() as http:
        r = await http.get(f"/api/sessions/{session}/stream", **kw)
    if how == "header" and offset == "\u00b2":  # sent as UTF-8 bytes, read as Latin-1
        shown = repr(offset.encode().decode("latin-1"))
    message = f"invalid Last-Event-ID offset {shown}: expected an event id like 1700000000000-0"
    assert (r.status_code, r.json()) == (422, error(422, "INVALID_ARGUMENT", message))


async def test_percent_encoded_superscript_two(mesh: Mesh) -> None:
    async with mesh.http() as http:
        r = await http.get("/api/sessions/any-session/stream?lastEventId=%C2%B2")
    message = "invalid Last-Event-ID offset '²': expected an event id like 1700000000000-0"
    assert (r.status_code, r.json()) == (422, error(422, "INVALID_ARGUMENT", message))


async def test_a_trailing_slash_is_not_redirected(mesh: Mesh) -> None:
    """Starlette redirected /api/sessions/ to /api/sessions with 307, method kept: DELETE of an empty
    id (`DELETE /api/sessions/`) became DELETE /api/sessions, every session of the caller."""
    session = (await chat(mesh, "general", "keep me"))[0]["traceId"]
    async with mesh.http() as http:
        for method in ("DELETE", "GET"):
            r = await http.request(method, "/api/sessions/")
            assert (r.status_code, r.json()) == (404, error(404, "NOT_FOUND", "no route /api/sessions/"))
        assert (await http.get(f"/api/sessions/{session}")).status_code == 200


@pytest.mark.parametrize(
    ("if_match", "shown"),
    [
        ("\u00b2".encode("latin-1"), "²"),
        (b"9" * 5000, "5000 digits"),
        (b'W/"0"', "version 0"),
        (b"v4", "letters"),
    ],
    ids=["superscript-two", "5000-digits", "version-0", "letters"],
)
async def test_hostile_if_match_is_a_422(mesh: Mesh, if_match: bytes, shown: str) -> None:
    """str.isdigit() took '²' and int() then refused it; 5,000 digits passed isdigit() and int() refused
    those too: both were 500s."""
    async with mesh.http() as http:
        r = await http.patch("/api/agents/no-such-agent", json={}, headers={b"If-Match": if_match})
    message = 'If-Match must be the version of the agent, as its ETag gives it ("3")'
    assert (r.status_code, r.json()) == (422, error(422, "INVALID_ARGUMENT", message)), shown


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "invalid request: body: nested deeper than 32 levels"),
        (b'{"name": ' + b"9" * 5000 + b"}", "invalid request: body: an integer has more than 20 digits"),
        (b'{"limits": {"maxSteps": NaN}}', "invalid request: body: NaN is not a JSON number"),
        (b"\xff", "the body must be a JSON object: an agent"),
    ],
    ids=["nested-100000", "5000-digit-number", "NaN", "invalid-utf8"],
)
async def test_agent_bodies_that_are_not_json_are_a_422(mesh: Mesh, body: bytes, message: str) -> None:
    """The JSON bound (libs/jsonbound.py) answers first, for every route alike; then the route's parser."""
    async with mesh.http() as http:
        r = await http.post("/api/agents", content=body, headers={"content-type": "application/json"})
    assert (r.status_code, r.json()) == (422, error(422, "INVALID_ARGUMENT", message))


async def test_only_get_on_the_agent_options(mesh: Mesh) -> None:
    """/api/agents/options is a route of its own: no agent is written under that slug."""
    async with mesh.http() as http:
        for method in ("PATCH", "DELETE", "POST"):
            r = await http.request(method, "/api/agents/options", json={})
            assert (r.status_code, r.headers["allow"]) == (405, "GET"), method
        assert (await http.get("/api/agents/options")).status_code == 200
