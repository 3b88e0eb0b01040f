"""A cap on request bodies: larger ones get 413 with a JSON error before the app reads them whole."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 1024 * 1024


async def _reject(send: Send, limit: int) -> None:
    body = json.dumps(
        {
            "error": {
                "code": 413,
                "reason": "RESOURCE_EXHAUSTED",
                "message": f"request body over {limit} bytes",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _reject(send, self.max_bytes)
            return
        seen = 0
        exceeded = False

        async def counted() -> Message:
            nonlocal seen, exceeded
            if exceeded:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a body without a length that grew too large: stop reading
                    exceeded = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def answer(message: Message) -> None:
            if not exceeded:
                await send(message)
            elif message["type"] == "http.response.start":
                await _reject(send, self.max_bytes)  # whatever the app made of the cut body

        await self.app(scope, counted, answer)
