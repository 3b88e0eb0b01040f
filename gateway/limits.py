"""The gateway's size limits, one set for HTTP and WebSocket, enforced before any route runs.

- Request head: a request line or a header line of at most 8 KiB with its CRLF (MAX_LINE_BYTES, the
  limit of the `websockets` handshake parser, so an upgrade and a plain request agree), at most
  MAX_HEADERS headers and MAX_HEAD_BYTES in all: beyond that 414 (the request line) or 431 (headers),
  JSON, and the connection closes. uvicorn's h11 parser also drops a head that grows past
  MAX_HEAD_BYTES while still incomplete (a plain 400 and close; gateway/server.py `http_limits`).
- Request body: at most MAX_BODY_BYTES, else 413 before the app reads it whole; complete within
  BODY_TIMEOUT_S of the request's start, else 408 and close.
- A WebSocket upgrade meets the same head limits, with the same 414/431 JSON answers
  (HeadTimeoutProtocol.handle_websocket_upgrade), before the `websockets` parser sees it.
- WebSocket: a message of at most MAX_BODY_BYTES, else the socket closes with 1009 (uvicorn's
  `ws_max_size`, gateway/server.py).
- Time: a connection has HEAD_TIMEOUT_S to send a whole request head after connecting or after its
  last response (HeadTimeoutProtocol), else it closes (with 408 if part of a head had come).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import struct
import termios
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentmesh.gateway.errors import HttpError
from agentmesh.libs.errors import MeshError, ResourceExhausted

MAX_BODY_BYTES = 1024 * 1024
MAX_LINE_BYTES = 8192  # with its CRLF, like websockets' MAX_LINE_LENGTH
MAX_HEADERS = 100
MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0


async def answer_error(scope: Scope, send: Send, err: MeshError, close: bool = False) -> None:
    """The JSON error as the whole response; for a WebSocket handshake, its HTTP answer (ASGI
    `websocket.http.response`). `close`: the connection closes after it."""
    body = json.dumps(err.json_body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    kind = "websocket.http.response" if scope["type"] == "websocket" else "http.response"
    await send({"type": f"{kind}.start", "status": err.http_status, "headers": headers})
    await send({"type": f"{kind}.body", "body": body})


def head_error(scope: Scope) -> MeshError | None:
    """What is wrong with the request head of `scope`, if anything."""
    target = len(scope.get("raw_path") or b"") + (
        len(scope["query_string"]) + 1 if scope.get("query_string") else 0
    )
    method = scope.get("method", "GET")
    line = len(method) + 1 + target + len(" HTTP/1.1\r\n")
    if line > MAX_LINE_BYTES:
        return HttpError(f"request line over {MAX_LINE_BYTES} bytes", reason="RESOURCE_EXHAUSTED", status=414)
    headers = scope.get("headers") or []
    if len(headers) > MAX_HEADERS:
        return HttpError(f"more than {MAX_HEADERS} request headers", reason="RESOURCE_EXHAUSTED", status=431)
    total = line
    for name, value in headers:
        size = len(name) + 2 + len(value) + 2
        if size > MAX_LINE_BYTES:
            return HttpError(
                f"request header {name[:40].decode('latin-1')!r} over {MAX_LINE_BYTES} bytes",
                reason="RESOURCE_EXHAUSTED",
                status=431,
            )
        total += size
    if total > MAX_HEAD_BYTES:
        return HttpError(
            f"request headers over {MAX_HEAD_BYTES} bytes", reason="RESOURCE_EXHAUSTED", status=431
        )
    return None


class HeadLimitMiddleware:
    """414/431 for a request head over the limits, before routing, for HTTP and WebSocket alike."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            err = head_error(scope)
            if err is not None:
                await answer_error(scope, send, err, close=True)  # nothing more is read from this client
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: at once when Content-Length says so, else as soon as the bytes
    that arrived pass it; 408 (and close) for a body still incomplete `timeout_s` after the request
    began. Either way the app sees the body end there, and its answer is replaced."""

    def __init__(
        self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, timeout_s: float = BODY_TIMEOUT_S
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = ResourceExhausted(f"request body over {self.max_bytes} bytes")
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await answer_error(scope, send, too_large)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        seen = 0
        complete = False
        failed: MeshError | None = None
        cut: Message = {"type": "http.request", "body": b"", "more_body": False}

        async def counted() -> Message:
            nonlocal seen, complete, failed
            if failed is not None:
                return cut
            if complete:  # after the body: only http.disconnect, whenever it comes
                return await receive()
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                failed = HttpError(
                    f"request body not complete within {self.timeout_s:g} s",
                    reason="DEADLINE_EXCEEDED",
                    status=408,
                )
                return cut
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > self.max_bytes:  # a body without a length that grew too large: stop reading
                    failed = too_large
                    return cut
            return message

        async def answer(message: Message) -> None:
            if failed is None:
                await send(message)
            elif message["type"] == "http.response.start":  # whatever the app made of the cut body
                await answer_error(scope, send, failed, close=failed.http_status == 408)

        await self.app(scope, counted, answer)


class HeadTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on the request head. uvicorn has none: a client that
    connects and sends nothing, or sends a head a byte at a time, holds its socket for ever (its
    keep-alive timer runs only after a response, and any byte stops it). Here, whenever the client owes
    a request head (h11's IDLE), a timer of `head_timeout_s` runs that no partial data resets; when it
    fires the connection closes, after a 408 JSON answer if part of a head had come. Bytes the client
    sent that the gateway has not read yet (a loop saturated by a burst of connections) are the
    gateway's delay, not the client's: then the timer runs again."""

    head_timeout_s: float = HEAD_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None

    def _watch_head(self) -> None:
        owed = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
        if owed and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)
        elif not owed and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if _unread_bytes(self.transport):  # it came, the loop has not read it yet: ours to wait for
            self._watch_head()
            return
        if self.conn.trailing_data[0]:  # part of a head came: say why the connection ends
            err = HttpError(
                f"no complete request head within {self.head_timeout_s:g} s",
                reason="DEADLINE_EXCEEDED",
                status=408,
            )
            body = json.dumps(err.json_body()).encode()
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                + body
            )
        self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_head()

    def handle_events(self) -> None:
        super().handle_events()
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        """An upgrade whose head breaks the limits gets the documented 414/431 JSON here: handed to the
        `websockets` implementation, its own parser would answer 400 text/plain ("line too long")."""
        path, _, query = event.target.partition(b"?")
        scope = {
            "type": "websocket",
            "method": event.method.decode("latin-1"),
            "raw_path": path,
            "query_string": query,
            "headers": list(self.headers),
        }
        err = head_error(scope)
        if err is None:
            super().handle_websocket_upgrade(event)
            return
        body = json.dumps(err.json_body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        self.transport.write(self.conn.send(h11.Response(status_code=err.http_status, headers=headers)))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """How many bytes the peer sent that the socket holds unread (0 when that cannot be told)."""
    sock = transport.get_extra_info("socket")
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except (AttributeError, OSError, ValueError):
        return 0


class TraceGZipMiddleware:
    """gzip for the trace API (/api/traces): what peers read in bulk. Starlette's GZipMiddleware, which
    compresses only when the client sends Accept-Encoding: gzip and never text/event-stream."""

    def __init__(self, app: ASGIApp, minimum_size: int = 1000) -> None:
        from starlette.middleware.gzip import GZipMiddleware

        self.app = app
        self.gzip = GZipMiddleware(app, minimum_size=minimum_size)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/api/traces/"):
            await self.gzip(scope, receive, send)
        else:
            await self.app(scope, receive, send)
