"""libs.identity: signed, expiring identity tokens and the acting principal of a task."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest

from agentmesh.libs import identity
from agentmesh.libs.errors import Unauthenticated
from agentmesh.libs.identity import LEEWAY_S, Principal, Signer, load_secret

SECRET = b"unit-test-mesh-secret-0123456789"


def test_a_token_names_its_user_and_nothing_else_verifies() -> None:
    signer = Signer(SECRET)
    assert signer.verify(signer.mint("alice")) == Principal("alice")
    assert signer.verify(signer.mint("")).is_mesh
    assert signer.mint("alice") == signer.mint("alice"), "reused while young"
    other = Signer(b"another-secret-of-sixteen-bytes")
    for bad in (None, "", "v1", "v1.x.y", "v2." + signer.mint("a")[3:], other.mint("alice")):
        with pytest.raises(Unauthenticated):
            signer.verify(bad)


def test_claims_cannot_be_changed_without_the_secret() -> None:
    signer = Signer(SECRET)
    sig = signer.mint("alice").rsplit(".", 1)[1]
    forged = base64.urlsafe_b64encode(json.dumps({"u": "root", "exp": 9e9}).encode()).decode().rstrip("=")
    with pytest.raises(Unauthenticated, match="signature"):
        signer.verify(f"v1.{forged}.{sig}")


def test_tokens_expire_and_are_renewed() -> None:
    now = [1_000_000.0]
    signer = Signer(SECRET, ttl_s=60, clock=lambda: now[0])
    token = signer.mint("bob")
    now[0] += 31  # past half its life: a new one is minted
    assert signer.mint("bob") != token
    now[0] += 60 + LEEWAY_S
    with pytest.raises(Unauthenticated, match="expired"):
        signer.verify(token)


def test_a_verified_token_is_remembered_until_it_expires() -> None:
    now = [1_000_000.0]
    signer = Signer(SECRET, ttl_s=60, clock=lambda: now[0])
    token = signer.mint("carol")
    assert signer.verify(token) == Principal("carol")
    assert token in signer._verified, "verified once, then looked up"
    forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
    with pytest.raises(Unauthenticated):  # the cache is keyed by the whole token, signature included
        signer.verify(forged)
    now[0] += 59
    assert signer.verify(token) == Principal("carol")
    now[0] += 1 + LEEWAY_S + 0.5  # past its expiry: refused, although it was verified before
    with pytest.raises(Unauthenticated, match="expired"):
        signer.verify(token)
    with pytest.raises(Unauthenticated, match="expired"):
        signer.verify(token)  # and again, now without the cache


def test_short_secrets_are_refused() -> None:
    with pytest.raises(ValueError):
        Signer(b"short")


async def test_the_principal_is_per_task() -> None:
    seen: dict[str, str] = {}

    async def work(user: str) -> None:
        with identity.acting_as(user):
            await asyncio.sleep(0)
            seen[user] = identity.current_user()

    await asyncio.gather(work("a"), work("b"))
    assert seen == {"a": "a", "b": "b"}
    assert identity.current() is None
    with identity.acting_as(""), pytest.raises(Unauthenticated):
        identity.current_user()


def test_the_secret_file_is_created_once(tmp_path: object) -> None:
    from pathlib import Path

    d = Path(str(tmp_path))
    first = load_secret("", d)
    assert load_secret("", d) == first and len(first) >= 32
    assert (d / "mesh_secret").stat().st_mode & 0o777 == 0o600
    assert load_secret("explicit-secret", d) == b"explicit-secret"
    with pytest.raises(RuntimeError):
        load_secret("", d / "missing", create=False)
