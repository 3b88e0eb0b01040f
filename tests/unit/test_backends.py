"""tests/backends.py: where the suite's PostgreSQL and Redis come from. The choice, the containers'
URLs, and that the container path calls testcontainers as the pinned release takes it; with a Docker
engine (not on every machine) the containers are started and answer."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

from tests import backends


def never() -> bool:
    raise AssertionError("Docker was asked although the environment names the backends")


def test_the_environment_wins_and_docker_is_not_asked() -> None:
    assert backends.choose({"TEST_DATABASE_URL": "postgresql://db/test"}, never) == "environment"
    assert backends.choose({"TEST_REDIS_URL": "redis://r:6379/0"}, never) == "environment"
    assert backends.configured_urls({"TEST_REDIS_URL": "redis://r:6379/0"}) == (
        backends.LOCAL_DATABASE_URL,
        "redis://r:6379/0",
    )


def test_containers_when_docker_answers_else_the_local_servers() -> None:
    assert backends.choose({}, lambda: True) == "containers"
    assert backends.choose({"TEST_DATABASE_URL": ""}, lambda: True) == "containers"  # empty is unset
    assert backends.choose({}, lambda: False) == "local"
    assert backends.configured_urls({}) == (
        "postgresql://postgres@127.0.0.1:5432/test",
        "redis://127.0.0.1:6379/0",
    )


def test_no_engine_means_no_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    started = time.monotonic()
    assert backends.docker_answers() is False
    assert time.monotonic() - started < 5
    assert backends.choose({}) == "local"


def test_the_containers_urls() -> None:
    assert (
        backends.postgres_url("127.0.0.1", 32768)
        == "postgresql://postgres:agentmesh-test@127.0.0.1:32768/test"
    )
    assert backends.redis_url("localhost", "32769") == "redis://localhost:32769/0"


def test_the_container_path_calls_testcontainers_as_it_takes_it() -> None:
    """The arguments postgres_container and redis_container give bind to the installed release's
    classes (their constructors need an engine, so they are not called here)."""
    postgres = backends._community("postgres").PostgresContainer
    inspect.signature(postgres).bind(
        backends.POSTGRES_IMAGE, username="postgres", password="x", dbname="test", driver=None
    )
    for name in ("get_container_host_ip", "get_exposed_port", "__enter__", "__exit__"):
        assert callable(getattr(postgres, name)), name
    redis = backends._community("redis").RedisContainer
    inspect.signature(redis).bind(backends.REDIS_IMAGE)
    assert callable(redis.get_exposed_port)


@pytest.mark.skipif(not backends.docker_answers(), reason="no Docker engine answers on this machine")
def test_the_containers_serve() -> None:
    import asyncpg
    import redis

    with backends.redis_container() as url:
        assert redis.Redis.from_url(url).ping()
    with backends.postgres_container() as url:

        async def version() -> str:
            conn = await asyncpg.connect(url)
            try:
                return str(await conn.fetchval("select version()"))
            finally:
                await conn.close()

        assert asyncio.run(version()).startswith("PostgreSQL 16")
