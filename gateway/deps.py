"""Request dependencies of the gateway: the gRPC clients and the authenticated user."""

from __future__ import annotations

import time

from fastapi import Request

from agentmesh.v1 import trace_service_pb2 as ts
from libs.clients import Clients
from libs.config import MeshSettings
from libs.errors import Unauthenticated, call

_AUTH_CACHE_S = 30.0


def clients(request: Request) -> Clients:
    return request.app.state.clients  # type: ignore[no-any-return]


def settings(request: Request) -> MeshSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


async def authenticate(app_state: object, header: str | None) -> str:
    """The user behind `Authorization: Bearer KEY`; raises Unauthenticated (401)."""
    if not header or not header.lower().startswith("bearer "):
        raise Unauthenticated("missing bearer token: send Authorization: Bearer KEY")
    key = header[7:].strip()
    if not key:
        raise Unauthenticated("missing bearer token: send Authorization: Bearer KEY")
    cache: dict[str, tuple[str, float]] = app_state.auth_cache  # type: ignore[attr-defined]
    hit = cache.get(key)
    now = time.monotonic()
    if hit and hit[1] > now:
        return hit[0]
    resp = await call(
        app_state.clients.trace.AuthenticateApiKey(ts.AuthenticateApiKeyRequest(api_key=key))  # type: ignore[attr-defined]
    )
    if len(cache) > 10_000:
        cache.clear()
    cache[key] = (resp.user, now + _AUTH_CACHE_S)
    return resp.user


async def current_user(request: Request) -> str:
    return await authenticate(request.app.state, request.headers.get("authorization"))
