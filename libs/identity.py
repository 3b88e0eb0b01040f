"""Who is calling, learned from the call and verified, never from a request field.

The gateway authenticates a user's API key; from then on the acting user travels with every gRPC
call as a short-lived token signed with the mesh secret (HMAC-SHA256) in the `x-agentmesh-identity`
metadata. Every service checks it in a server interceptor (a call without a valid token gets
UNAUTHENTICATED) and hands the principal to the handler through a context variable; the client
interceptor signs a fresh token for the principal in the context on every outgoing call, so the
user flows down the tree of calls by itself. A call made outside any user's work (the gateway
checking a key, a reaper settling orphans) carries the mesh's own principal: a token with no user.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentmesh.libs.errors import Unauthenticated
from agentmesh.libs.files import private_dir

HEADER = "x-agentmesh-identity"
TOKEN_TTL_S = 300.0
LEEWAY_S = 30.0  # clock skew between machines
SECRET_FILE = "mesh_secret"


@dataclass(frozen=True)
class Principal:
    """A verified caller: a user, or the mesh itself (user "")."""

    user: str = ""

    @property
    def is_mesh(self) -> bool:
        return not self.user


MESH = Principal("")
_current: contextvars.ContextVar[Principal | None] = contextvars.ContextVar(
    "agentmesh_principal", default=None
)


def current() -> Principal | None:
    """The verified principal of the work in progress (None outside any call or request)."""
    return _current.get()


def current_user() -> str:
    """The acting user; Unauthenticated when the call carries none (the mesh's own principal)."""
    return user_of(_current.get())


def user_of(principal: Principal | None) -> str:
    """The user `principal` acts for; Unauthenticated for none or the mesh's own principal."""
    if principal is None or principal.is_mesh:
        raise Unauthenticated("this call needs a user's identity")
    return principal.user


def set_principal(principal: Principal) -> None:
    """Makes `principal` the acting one for the rest of this task (and the tasks it starts)."""
    _current.set(principal)


@contextlib.contextmanager
def acting_as(user: str) -> Iterator[Principal]:
    """Runs the block (and the calls it makes) as `user` ("" for the mesh itself)."""
    principal = Principal(user)
    token = _current.set(principal)
    try:
        yield principal
    finally:
        _current.reset(token)


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class Signer:
    """Signs and verifies identity tokens with the mesh secret: `v1.<claims>.<hmac>`."""

    def __init__(self, secret: bytes, ttl_s: float = TOKEN_TTL_S, clock: Any = time.time) -> None:
        if len(secret) < 16:
            raise ValueError("the mesh secret must be at least 16 bytes")
        self._key = secret
        self.ttl_s = ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[str, float]] = {}
        # Tokens already verified -> (principal, expiry): a token is minted once and reused for half its
        # life, so every call after the first of a token costs a dict look-up, not an HMAC and a JSON parse.
        self._verified: dict[str, tuple[Principal, float]] = {}

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self._key, payload.encode(), hashlib.sha256).digest())

    def mint(self, user: str) -> str:
        """A token for `user` ("" for the mesh); reused while more than half of its life is left."""
        now = self._clock()
        hit = self._cache.get(user)
        if hit is not None and hit[1] - now > self.ttl_s / 2:
            return hit[0]
        expires = now + self.ttl_s
        payload = "v1." + _b64(json.dumps({"u": user, "exp": int(expires)}, separators=(",", ":")).encode())
        token = f"{payload}.{self._sign(payload)}"
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[user] = (token, expires)
        return token

    def verify(self, token: str | bytes | None) -> Principal:
        """The principal of a valid token; Unauthenticated for a missing, malformed, forged or expired one."""
        if not token:
            raise Unauthenticated("missing caller identity")
        if isinstance(token, bytes):
            token = token.decode("ascii", "replace")
        hit = self._verified.get(token)
        if hit is not None:
            if hit[1] + LEEWAY_S < self._clock():
                del self._verified[token]
                raise Unauthenticated("caller identity expired")
            return hit[0]
        version, _, rest = token.partition(".")
        claims, _, signature = rest.partition(".")
        if version != "v1" or not claims or not signature:
            raise Unauthenticated("malformed caller identity")
        if not hmac.compare_digest(signature, self._sign(f"v1.{claims}")):
            raise Unauthenticated("caller identity has a bad signature")
        try:
            data = json.loads(_unb64(claims))
            user, expires = data["u"], float(data["exp"])
        except (ValueError, KeyError, TypeError) as exc:
            raise Unauthenticated("malformed caller identity") from exc
        if not isinstance(user, str) or expires + LEEWAY_S < self._clock():
            raise Unauthenticated("caller identity expired")
        principal = Principal(user)
        if len(self._verified) > 10_000:
            self._verified.clear()
        self._verified[token] = (principal, expires)
        return principal


def load_secret(explicit: str, data_dir: Path, create: bool = True) -> bytes:
    """The mesh secret: `explicit` (AGENTMESH_MESH_SECRET) when set, else `<data_dir>/mesh_secret`,
    created when missing and `create` is true (written to a temporary file, then linked into place,
    so processes starting together all read the same complete secret)."""
    if explicit:
        return explicit.encode()
    path = data_dir / SECRET_FILE
    if not path.exists() and create:
        private_dir(data_dir)
        tmp = data_dir / f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    try:
        return path.read_text().strip().encode()
    except OSError as exc:
        raise RuntimeError(f"no mesh secret: set AGENTMESH_MESH_SECRET or create {path}") from exc


def signer_for(settings: Any) -> Signer:
    """The signer of a process, from its MeshSettings (mesh_secret, else the secret file in data_dir)."""
    return Signer(load_secret(settings.mesh_secret, settings.data_dir))
