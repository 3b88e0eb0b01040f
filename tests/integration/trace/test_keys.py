"""AuthService: API keys are created per user, resolve to their user, and are stored only as hashes."""

from __future__ import annotations

import hashlib
import re

import grpc

from agentmesh.auth.v1 import auth_service_pb2 as au
from tests.integration.trace.conftest import count_rows, error_of

BAD = grpc.StatusCode.INVALID_ARGUMENT


async def test_api_keys(auth_stub, trace_engine, unique):
    # The mesh itself (no user) calls AuthService: the gateway checking a key, `agentmesh keys create`.
    user = f"u-{unique}"
    created = await auth_stub.CreateApiKey(au.CreateApiKeyRequest(user=user))
    assert created.user == user and re.fullmatch(r"am_[A-Za-z0-9_-]{43}", created.api_key)
    second = await auth_stub.CreateApiKey(au.CreateApiKeyRequest(user=user))
    assert second.api_key != created.api_key and second.user == user
    for key in (created.api_key, second.api_key):
        assert (await auth_stub.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key=key))).user == user
    for key, message in (
        ("am_wrong", "invalid API key"),
        (created.api_key + "x", "invalid API key"),
        ("", "missing API key"),
    ):
        error = await error_of(auth_stub.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key=key)))
        assert (error.code(), error.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)
    for bad_user in ("", "x" * 201):
        assert (await error_of(auth_stub.CreateApiKey(au.CreateApiKeyRequest(user=bad_user)))).code() == BAD
    # Only hashes are stored; both keys were used once.
    plain = await count_rows(
        trace_engine, "SELECT count(*) FROM api_keys WHERE key_hash = :k", k=created.api_key
    )
    hashed = await count_rows(
        trace_engine,
        "SELECT count(*) FROM api_keys WHERE key_hash = :k",
        k=hashlib.sha256(created.api_key.encode()).hexdigest(),
    )
    used = await count_rows(
        trace_engine,
        "SELECT count(*) FROM api_keys k JOIN users u ON u.id = k.user_id"
        " WHERE u.name = :u AND k.last_used_at IS NOT NULL",
        u=user,
    )
    assert (plain, hashed, used) == (0, 1, 2)
