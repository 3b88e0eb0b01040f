"""The receiver of push notifications for the remote tasks our agents called (docs/a2a.md#push-
notifications-of-remote-tasks): `POST /a2a/push/{id}`. The agent-runtime that waits for the task made the
buffer `push:<id>` with what a notification must show (services/agent_runtime/a2a_push.py): the
config's token (`X-A2A-Notification-Token`, compared by its SHA-256), and when the remote signs
(`Authorization: Bearer <JWT>`), a JWT valid under the remote's JWKS with our URL as `aud`, a fresh
`iat` and, when it says one, the body's `request_body_sha256`. A notification that passes is appended
to that buffer; the runtime does the rest. No API key: the token is the credential. Refusals are the
gateway's JSON errors: no such receiver 404, a missing or wrong token or signature 401, a body that
is not a notification 422."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Mapping
from typing import Any

import httpx
import jwt
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity, jsonbound
from agentmesh.libs.a2a import PUSH_AUDIENCE, PUSH_JWKS_URL, PUSH_TOKEN_SHA256, parse_push_notification
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable, rpc
from agentmesh.libs.ids import is_local_id, push_key
from agentmesh.stream.v1 import stream_service_pb2 as ss

router = APIRouter(include_in_schema=False)
PATH = "/a2a/push/{receiver_id}"
PATHS = ((PATH, ("POST",)),)  # for the gateway's 405 answers (gateway/errors.py)
TOKEN_HEADER = "x-a2a-notification-token"
ALGORITHMS = ["RS256", "RS384", "RS512", "PS256", "ES256", "ES384", "EdDSA"]
LEEWAY_S = 30.0  # clock skew between meshes
MAX_JWKS_BYTES = 64 * 1024


class PushReceiver:
    def __init__(self, clients: Clients, settings: MeshSettings) -> None:
        self.clients = clients
        self.settings = settings.a2a
        self.timeout_s = settings.rpc_timeout_s
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.federation.timeout_s), follow_redirects=False, trust_env=False
        )
        self.jwks: dict[str, tuple[float, jwt.PyJWKSet]] = {}  # url -> (expiry, keys)

    async def take(self, receiver_id: str, headers: Mapping[str, str], body: bytes) -> None:
        """Checks one notification and hands it to the runtime waiting for it (its push:<id> buffer)."""
        if not is_local_id(receiver_id):
            raise NotFound("no such push receiver")
        key = push_key(receiver_id)
        with identity.acting_as(""):
            info = await rpc(
                self.clients.stream.GetStreamInfo(ss.GetStreamInfoRequest(key=key), timeout=self.timeout_s)
            )
            meta = info.metadata
            if not info.exists or info.closed or PUSH_TOKEN_SHA256 not in meta:
                raise NotFound("no such push receiver (the task it waited for may have ended)")
            token = headers.get(TOKEN_HEADER, "")
            digest = hashlib.sha256(token.encode()).hexdigest()
            if not token or not hmac.compare_digest(digest, meta[PUSH_TOKEN_SHA256]):
                raise Unauthenticated("the push notification's token is missing or wrong")
            auth = headers.get("authorization", "")
            if auth[:7].lower() == "bearer " and auth.count(".") == 2:
                await self._verify_jwt(
                    auth[7:].strip(), meta.get(PUSH_JWKS_URL, ""), meta.get(PUSH_AUDIENCE, ""), body
                )
            try:
                text = body.decode()
                parse_push_notification(text)
            except ValueError as exc:  # also a ParseError and a UnicodeDecodeError
                raise InvalidArgument(
                    "the body is not an A2A push notification (a StreamResponse JSON)"
                ) from exc
            append = ss.AppendEventsRequest(
                key=key, events=[ev.Event(remote_push_notification=ev.RemotePushNotification(body_json=text))]
            )
            await rpc(self.clients.stream.AppendEvents(append, timeout=self.timeout_s))

    async def _verify_jwt(self, token: str, jwks_url: str, audience: str, body: bytes) -> None:
        try:
            kid = jwt.get_unverified_header(token).get("kid", "")
            key = await self._key(jwks_url, str(kid))
            claims: dict[str, Any] = jwt.decode(
                token,
                key,
                algorithms=ALGORITHMS,
                audience=audience,
                leeway=LEEWAY_S,
                options={"require": ["iat", "aud"]},
            )
        except jwt.PyJWTError as exc:
            raise Unauthenticated(f"the push notification's signature was refused: {exc}") from exc
        iat = float(claims["iat"])
        if time.time() - iat > self.settings.push_max_age_s + LEEWAY_S:
            raise Unauthenticated("the push notification's signature is too old (iat)")
        digest = claims.get("request_body_sha256")
        if digest is not None and not hmac.compare_digest(str(digest), hashlib.sha256(body).hexdigest()):
            raise Unauthenticated("the push notification's body is not the one signed")

    async def _key(self, url: str, kid: str) -> Any:
        """The remote's key `kid` from its JWKS (cached; fetched again once for an unknown kid)."""
        hit = self.jwks.get(url)
        for fresh in (False, True):
            if hit is None or hit[0] < time.monotonic() or fresh:
                hit = await self._fetch(url)
            for found in hit[1].keys:
                if not kid or found.key_id == kid:
                    return found.key
        raise jwt.InvalidKeyError(f"no key {kid!r} in the remote agent's JWKS")

    async def _fetch(self, url: str) -> tuple[float, jwt.PyJWKSet]:
        try:
            async with self.http.stream("GET", url) as resp:
                status, data = resp.status_code, b""
                async for chunk in resp.aiter_bytes():
                    data += chunk
                    if len(data) > MAX_JWKS_BYTES:
                        raise jwt.PyJWKSetError(f"the remote agent's JWKS at {url} is over 64 KiB")
            if status >= 500:  # a passing failure: the remote retries the notification
                raise Unavailable(f"the remote agent's JWKS answered HTTP {status}")
            if status != 200:
                raise jwt.PyJWKSetError(f"the remote agent serves no JWKS at {url} (HTTP {status})")
            keys = jwt.PyJWKSet.from_dict(jsonbound.loads(data))
        except jwt.PyJWKSetError:
            raise
        except (httpx.HTTPError, ValueError, jwt.PyJWTError, jsonbound.BoundError) as exc:
            raise Unavailable(
                f"the remote agent's JWKS is unreachable or invalid ({type(exc).__name__})"
            ) from exc
        hit = (time.monotonic() + self.settings.push_jwks_ttl_s, keys)
        self.jwks[url] = hit
        return hit

    async def aclose(self) -> None:
        await self.http.aclose()


@router.post(PATH)
async def receive(receiver_id: str, request: Request) -> JSONResponse:
    receiver: PushReceiver = request.app.state.push_receiver
    await receiver.take(receiver_id, request.headers, await request.body())
    return JSONResponse({"status": "ok"})
