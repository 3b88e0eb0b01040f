"""The JSON bound (libs/jsonbound.py) on every JSON request body of the HTTP API, before any route:
a body nested deeper than the bound, with an integer of too many digits, a number that is not finite
(`NaN`, `Infinity`, `1e400`) or a string holding U+0000 or a lone surrogate is a 422 with the JSON
error body, on SQLite and PostgreSQL alike. What is not JSON at all is left to the routes (FastAPI
answers it with its own 422). The A2A endpoint parses its own bodies, to answer in JSON-RPC
(gateway/a2a/routes.py)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentmesh.gateway.limits import answer_error
from agentmesh.libs import jsonbound


def _json_content(scope: Scope) -> bool:
    """FastAPI reads a body as JSON when its content type is JSON (or +json) or absent."""
    value = dict(scope.get("headers") or []).get(b"content-type")
    if value is None:
        return True
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or media.endswith(b"+json")


class JsonBoundMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") in ("GET", "HEAD", "OPTIONS")
            or not scope["path"].startswith("/api/")
            or not _json_content(scope)
        ):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        while True:  # the body is at most MAX_BODY_BYTES (BodyLimitMiddleware, outside this one)
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if body:
            try:
                jsonbound.loads(bytes(body), root="body")
            except jsonbound.BoundError as err:
                await answer_error(scope, send, jsonbound.BoundError(f"invalid request: {err.message}"))
                return
            except ValueError:
                pass  # not JSON: the route's own parser says so

        async def replay() -> Message:
            if messages:
                return messages.pop(0)
            return await receive()

        await self.app(scope, replay, send)
