"""Shared fixtures: real PostgreSQL and Redis (from TEST_DATABASE_URL / TEST_REDIS_URL, else from
containers when a Docker engine answers, else the local servers: tests/backends.py), skipped where
unreachable, a failure under CI=true."""

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
from tests import backends

# Before anything imports gRPC: the suite's in-process servers and clients run on the transport the
# services run on.
use_classic_transport()

if TYPE_CHECKING:
    from agentmesh.libs.config import MeshSettings
    from agentmesh.libs.identity import Signer

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
def backend_source() -> backends.Source:
    """Where this session's PostgreSQL and Redis come from (asked once: Docker's ping takes a moment)."""
    return backends.choose(os.environ)


@pytest.fixture(scope="session")
def pg_admin_url(backend_source: backends.Source) -> Iterator[str]:
    """The PostgreSQL server's admin URL: configured, local, or a container started for the session."""
    if backend_source == "containers":
        with backends.postgres_container() as url:
            yield url
        return
    url = backends.configured_urls(os.environ)[0]
    _need(url, 5432, "PostgreSQL")
    yield url


@pytest.fixture(scope="session")
def pg_url(pg_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for this test run (dropped afterwards)."""
    import asyncpg

    name = f"agentmesh_test_{uuid.uuid4().hex[:10]}"
    admin = pg_admin_url.replace("postgresql+asyncpg://", "postgresql://")

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
def redis_url(backend_source: backends.Source) -> Iterator[str]:
    if backend_source == "containers":
        with backends.redis_container() as url:
            yield url
        return
    url = backends.configured_urls(os.environ)[1]
    _need(url, 6379, "Redis")
    yield url


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
