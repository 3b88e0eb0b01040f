"""Request dependencies of the gateway: the gRPC clients and the authenticated user.

The gateway is where a user's API key is checked; from there the user is the acting principal of the
request's work (libs.identity), and every gRPC call it makes carries that identity, signed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.libs import identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import Unauthenticated, rpc

_AUTH_CACHE_S = 30.0
# The scheme the OpenAPI document states; `authenticate` reads the header itself (auto_error off: its
# own 401 body, the same for a missing, malformed or unknown key).
bearer = HTTPBearer(auto_error=False, description="an API key: Authorization: Bearer am_...")


def clients(request: Request) -> Clients:
    return request.app.state.clients  # type: ignore[no-any-return]


def settings(request: Request) -> MeshSettings:
    return request.app.state.settings  # type: ignore[no-any-return]


# As dependencies, coroutines: FastAPI runs a plain `def` dependency in a worker thread, a thread hop
# (and two context switches) on every request.
async def clients_dep(request: Request) -> Clients:
    return clients(request)


async def settings_dep(request: Request) -> MeshSettings:
    return settings(request)


async def authenticate(app_state: Any, header: str | None) -> str:
    """The user behind `Authorization: Bearer KEY`, made the acting principal; raises Unauthenticated."""
    if not header or not header.lower().startswith("bearer "):
        raise Unauthenticated("missing bearer token: send Authorization: Bearer KEY")
    key = header[7:].strip()
    if not key or len(key) > 512:
        raise Unauthenticated("missing or malformed bearer token: send Authorization: Bearer KEY")
    cache: dict[str, tuple[str, float]] = app_state.auth_cache
    hit = cache.get(key)
    if hit and hit[1] > time.monotonic():
        user = hit[0]
    else:
        user = await _look_up(app_state, key)
    identity.set_principal(identity.Principal(user))
    return user


async def _look_up(app_state: Any, key: str) -> str:
    """The user of `key` from AuthService, one call for every request that asks meanwhile (a burst of
    requests with one key, its cache entry just expired, makes one call, not one each)."""
    pending: dict[str, asyncio.Future[str]] = app_state.auth_pending
    asking = pending.get(key)
    if asking is None:

        async def ask() -> str:
            try:
                with identity.acting_as(""):  # the mesh itself asks who the key belongs to
                    resp = await rpc(
                        app_state.clients.auth.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key=key))
                    )
            finally:
                del pending[key]
            cache: dict[str, tuple[str, float]] = app_state.auth_cache
            if len(cache) > 10_000:
                cache.clear()
            cache[key] = (resp.user, time.monotonic() + _AUTH_CACHE_S)
            return resp.user

        asking = pending[key] = asyncio.ensure_future(ask())
        # Its failure is each waiter's; when every waiter left first, nobody is left to retrieve it.
        asking.add_done_callback(lambda done: done.cancelled() or done.exception())
    return await asyncio.shield(asking)


async def current_user(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)] = None
) -> str:
    return await authenticate(request.app.state, request.headers.get("authorization"))
