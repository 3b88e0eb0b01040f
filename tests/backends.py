"""Where the suite's PostgreSQL and Redis come from (tests/conftest.py's `pg_url` and `redis_url`).

- `environment`: TEST_DATABASE_URL or TEST_REDIS_URL is set: those (and the default for the other).
- `containers`: neither is set and a Docker engine answers: testcontainers starts a PostgreSQL and a
  Redis container for the session (each only when a test first needs it), removed at its end.
- `local`: neither is set and no Docker engine answers: the servers on this machine's default ports.

A suite whose backend is missing is skipped, or fails under CI=true (conftest.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

Source = Literal["environment", "containers", "local"]
LOCAL_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
POSTGRES_IMAGE = "postgres:16-alpine"
REDIS_IMAGE = "redis:7-alpine"
POSTGRES_PASSWORD = "agentmesh-test"  # a throwaway container's, reachable from this machine only


def docker_answers(timeout_s: float = 2.0) -> bool:
    """A Docker engine answers a ping (DOCKER_HOST, else the default socket), within the timeout."""
    try:
        import docker

        client = docker.from_env(timeout=timeout_s)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # no SDK, no socket, no engine, no permission: no containers
        return False


def choose(environ: Mapping[str, str], docker: Callable[[], bool] = docker_answers) -> Source:
    """Where the backends come from: the environment's URLs, else containers when Docker answers,
    else the local servers. `docker` is asked only when the environment names no URL."""
    if environ.get("TEST_DATABASE_URL") or environ.get("TEST_REDIS_URL"):
        return "environment"
    return "containers" if docker() else "local"


def configured_urls(environ: Mapping[str, str]) -> tuple[str, str]:
    """(PostgreSQL admin URL, Redis URL) of the environment, or the local defaults."""
    return (
        environ.get("TEST_DATABASE_URL") or LOCAL_DATABASE_URL,
        environ.get("TEST_REDIS_URL") or LOCAL_REDIS_URL,
    )


def postgres_url(host: str, port: int | str, password: str = POSTGRES_PASSWORD) -> str:
    """The admin URL of the PostgreSQL container (user postgres, database test)."""
    return f"postgresql://postgres:{password}@{host}:{port}/test"


def redis_url(host: str, port: int | str) -> str:
    return f"redis://{host}:{port}/0"


def _community(name: str) -> Any:
    """testcontainers' module for `name`: testcontainers.community.<name> in recent 4.x releases,
    testcontainers.<name> before."""
    import importlib

    try:
        return importlib.import_module(f"testcontainers.community.{name}")
    except ImportError:
        return importlib.import_module(f"testcontainers.{name}")


@contextlib.contextmanager
def postgres_container() -> Iterator[str]:
    """A PostgreSQL container for the session; its admin URL."""
    container = _community("postgres").PostgresContainer(
        POSTGRES_IMAGE, username="postgres", password=POSTGRES_PASSWORD, dbname="test", driver=None
    )
    with container:
        yield postgres_url(container.get_container_host_ip(), container.get_exposed_port(5432))


@contextlib.contextmanager
def redis_container() -> Iterator[str]:
    """A Redis container for the session; its URL."""
    with _community("redis").RedisContainer(REDIS_IMAGE) as container:
        yield redis_url(container.get_container_host_ip(), container.get_exposed_port(6379))
