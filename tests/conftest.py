"""Shared fixtures: real PostgreSQL and Redis (from TEST_DATABASE_URL / TEST_REDIS_URL, else from
containers when a Docker engine answers, else the local servers: tests/backends.py), skipped where
unreachable, a failure under CI=true; and the mesh fixtures, `mesh` and `process_mesh` (below), which a
test module configures with its `mesh` marker."""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import os
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any
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
    from tests.mesh import Mesh, ProcessMesh

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


# ---- the mesh fixtures ---------------------------------------------------------------------------------
#
# A test module asks for `mesh` (the whole mesh in the test's loop: tests/mesh.py start_mesh) or
# `process_mesh` (every service its own process: start_process_mesh) and says in its `mesh` marker what
# its mesh differs in:
#
#     pytestmark = pytest.mark.mesh(rules=RULES, catalog=TEST_CATALOG, backends=BACKENDS)
#
# - `backends`: the backend pairs the module's tests run on, each a parameter of the fixture (and of the
#   test's id): "sqlite-memory" (the default) and "postgres-redis" (tests/mesh.py BACKENDS);
# - `scope`: "module" (the default: one mesh per module and backend pair, its tests in order on it) or
#   "function" (a fresh mesh per test, for tests that stop, kill or rewire it);
# - `user`: a prefix for a user of the mesh's own, made when it starts (the PostgreSQL database is shared
#   by every mesh of the run, and each has its "alice");
# - anything else goes to start_mesh or start_process_mesh as it is (rules, catalog, lease_s, settings).
#
# The closest marker counts, whole: a test's own `mesh` marker replaces its module's (repeat what it keeps).
#
# Options known only at run time (a catalog naming a server another fixture started) come from the
# `mesh_options` fixture, which such a module overrides; they update the marker's.

MESH_DEFAULTS: dict[str, Any] = {"backends": ("sqlite-memory",), "scope": "module", "user": ""}


def mesh_marker(node: pytest.Item | pytest.Collector) -> dict[str, Any]:
    """The `mesh` marker's options for `node` (its own, its class's or its module's), with the defaults."""
    marker = node.get_closest_marker("mesh")
    return {**MESH_DEFAULTS, **(marker.kwargs if marker else {})}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`mesh` and `process_mesh` take one parameter per backend pair of the marker, at its scope (a
    parametrisation's scope overrides the fixture's). A module with a fixture of that name of its own
    keeps it as it is."""
    options = mesh_marker(metafunc.definition)
    for name in ("mesh", "process_mesh"):
        if name in metafunc.fixturenames and not hasattr(metafunc.module, name):
            metafunc.parametrize(name, list(options["backends"]), indirect=True, scope=options["scope"])


@pytest.fixture(scope="module")
def mesh_options() -> dict[str, Any]:
    """Options of the module's mesh computed at run time (overridden by a module that has some)."""
    return {}


def _start_options(
    request: pytest.FixtureRequest, mesh_options: dict[str, Any]
) -> tuple[dict[str, Any], str]:
    """(what to start the mesh with, the user prefix): the marker's options, then `mesh_options`; copies,
    so that no mesh sees what another did to its settings."""
    options = mesh_marker(request.node)
    user = options.pop("user")
    for key in MESH_DEFAULTS:
        options.pop(key, None)
    options.update(mesh_options)
    return copy.deepcopy(options), user


@pytest.fixture(scope="module")
async def mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mesh_options: dict[str, Any]
) -> AsyncIterator[Mesh]:
    """The module's mesh (the test's, with scope="function") on the parameter's backend pair."""
    from tests.mesh import backend_urls, start_mesh

    options, user = _start_options(request, mesh_options)
    database_url, redis_url = backend_urls(request)
    if redis_url:
        options.update(database_url=database_url, stream_backend="redis", redis_url=redis_url)
    m = await start_mesh(tmp_path_factory.mktemp("mesh"), **options)
    try:
        if user:
            m.user = f"{user}-{uuid.uuid4().hex[:8]}"
            m.api_key = await m.new_user(m.user)
        yield m
    finally:
        await m.stop()


@pytest.fixture(scope="module")
async def process_mesh(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, mesh_options: dict[str, Any]
) -> AsyncIterator[ProcessMesh]:
    """The module's mesh of processes (the test's, with scope="function") on the parameter's backend
    pair; the marker gives its `rules`."""
    from tests.mesh import backend_urls, start_process_mesh

    options, user = _start_options(request, mesh_options)
    if user:
        raise ValueError("process_mesh has no user of its own (the mesh marker's `user`)")
    database_url, redis_url = backend_urls(request)
    m = await start_process_mesh(
        tmp_path_factory.mktemp("process-mesh"), database_url=database_url, redis_url=redis_url, **options
    )
    try:
        yield m
    finally:
        await m.stop()
