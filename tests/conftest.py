"""Shared fixtures: real PostgreSQL and Redis (skipped where unreachable, a failure under CI=true)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pytest

from agentmesh.libs.transport import use_classic_transport

# Before anything imports gRPC: the suite's in-process servers and clients run on the transport the
# services run on.
use_classic_transport()

if TYPE_CHECKING:
    from agentmesh.libs.config import MeshSettings
    from agentmesh.libs.identity import Signer

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
PG_ADMIN_URL = os.environ.get("TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


def _reachable(url: str, default_port: int) -> bool:
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), 1.0):
            return True
    except OSError:
        return False


def _need(url: str, port: int, what: str) -> None:
    if not _reachable(url, port):
        if CI:
            pytest.fail(f"{what} is not reachable at {url} (CI=true: a missing backend fails the run)")
        pytest.skip(f"{what} is not reachable at {url}")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test run (dropped afterwards)."""
    _need(PG_ADMIN_URL, 5432, "PostgreSQL")
    import asyncpg

    name = f"agentmesh_test_{uuid.uuid4().hex[:10]}"
    admin = PG_ADMIN_URL.replace("postgresql+asyncpg://", "postgresql://")

    async def execute(sql: str) -> None:
        conn = await asyncpg.connect(admin)
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    def run(sql: str) -> None:
        # Its own loop in its own thread: the fixture may be set up from inside a running loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(asyncio.run, execute(sql)).result()

    run(f'CREATE DATABASE "{name}"')
    parsed = urlparse(admin)
    yield parsed._replace(path=f"/{name}").geturl()
    run(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> str:
    _need(REDIS_URL, 6379, "Redis")
    return REDIS_URL


@pytest.fixture
def unique() -> str:
    """A short unique token for names, owners and keys of one test."""
    return uuid.uuid4().hex[:12]


TEST_SECRET = "agentmesh-test-mesh-secret-0123456789"


def service_settings(**values: object) -> MeshSettings:
    """Settings for services a test starts in its own process: the test mesh secret, loopback."""
    from agentmesh.libs.config import MeshSettings

    values.setdefault("mesh_secret", TEST_SECRET)
    return MeshSettings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def signer() -> Signer:
    """Signs identities the test services accept (`with identity.acting_as(user): ...` then call)."""
    from agentmesh.libs.identity import Signer

    return Signer(TEST_SECRET.encode())
