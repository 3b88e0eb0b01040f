"""The gateway's signature on push notifications (docs/a2a.md, "Push notifications"): each POST carries
`Authorization: Bearer <JWT>`, RS256, signed with the gateway's key, whose public half is served as a
JWKS at `/.well-known/jwks.json` (the JWT's `kid` names it). The claims bind the token to one delivery:
`iss` the gateway, `aud` the receiver's URL, `iat`/`exp` (5 minutes), a fresh `jti`, the task's id and
`request_body_sha256`, the SHA-256 of the exact body sent, so a receiver can check the body it got is the
one signed. Signing and the JWK are PyJWT's (with `cryptography`)."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from functools import cached_property
from pathlib import Path
from typing import Any

import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

ALGORITHM = "RS256"
JWKS_PATH = "/.well-known/jwks.json"
TOKEN_TTL_S = 300


def load_key(path: str) -> rsa.RSAPrivateKey:
    """The RSA private key of a PEM file."""
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ValueError(f"{path}: the push signing key must be an RSA private key")
    return key


class PushSigner:
    """Signs with the key of `key_file` (read at start, so a bad file stops the gateway there), or with
    a 2048-bit key generated on first use when there is none."""

    def __init__(self, key_file: str = "") -> None:
        self._key = load_key(key_file) if key_file else None

    @cached_property
    def key(self) -> rsa.RSAPrivateKey:
        return self._key or rsa.generate_private_key(public_exponent=65537, key_size=2048)

    @cached_property
    def jwk(self) -> dict[str, Any]:
        public = json.loads(RSAAlgorithm.to_jwk(self.key.public_key()))
        # The kid is the key's RFC 7638 thumbprint: the same key gives the same kid on every replica.
        members = json.dumps({k: public[k] for k in ("e", "kty", "n")}, separators=(",", ":"), sort_keys=True)
        kid = jwt.utils.base64url_encode(hashlib.sha256(members.encode()).digest()).decode()
        return {**public, "kid": kid, "use": "sig", "alg": ALGORITHM}

    def jwks(self) -> dict[str, Any]:
        return {"keys": [self.jwk]}

    def sign(self, *, issuer: str, audience: str, task_id: str, body: bytes) -> str:
        now = int(time.time())
        claims = {
            "iss": issuer,
            "aud": audience,
            "iat": now,
            "exp": now + TOKEN_TTL_S,
            "jti": uuid.uuid4().hex,
            "task_id": task_id,
            "request_body_sha256": hashlib.sha256(body).hexdigest(),
        }
        return jwt.encode(claims, self.key, algorithm=ALGORITHM, headers={"kid": self.jwk["kid"]})
