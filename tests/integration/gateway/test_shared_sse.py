"""Many browsers reading one buffer through one gateway (real uvicorn, real stream service on memory
and Redis): they share one subscription of the stream service, each from its own Last-Event-ID, and one
leaving ends none of the others (docs/design/streams.md#shared-follows)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from httpx_sse import aconnect_sse

from agentmesh.libs import events
from agentmesh.libs.identity import Signer
from agentmesh.services.stream.redis_backend import RedisBackend
from agentmesh.services.stream.server import build
from tests.integration.stream.conftest import (  # noqa: F401 - fixtures used by name
    Gateway,
    GatewayFactory,
    StreamFactory,
    StreamHarness,
    append,
    auth_trace,
    backend_kind,
    close,
    create,
    gateway_factory,
    stream,
    stream_factory,
)
from tests.integration.stream.test_shared_follows import the_same_buffers
from tests.mesh import wait_until


class Browser:
    """One SSE reader of `path` (optionally resuming after `last_id`), read by a task to its end or
    until it is told to leave."""

    def __init__(self, client: httpx.AsyncClient, path: str, last_id: str = "") -> None:
        self.client, self.path = client, path
        self.headers = {"Last-Event-ID": last_id} if last_id else {}
        self.got: list[tuple[str, dict[str, Any]]] = []
        self.leave = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        async with aconnect_sse(self.client, "GET", self.path, headers=self.headers) as source:
            assert source.response.status_code == 200
            async for sse in source.aiter_sse():
                self.got.append((sse.id, json.loads(sse.data)))
                if self.leave.is_set():
                    return

    @property
    def ids(self) -> list[str]:
        return [i for i, _ in self.got]


async def push(gw: Gateway, key: str, start: int, n: int) -> list[str]:
    return await append(gw.stream, key, [events.reasoning_delta(f"r{i}") for i in range(start, start + n)])


async def test_browsers_of_one_buffer_share_one_subscription(
    stream: StreamHarness,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
) -> None:
    gw = await gateway_factory(stream)
    key, path = f"trace:{unique}", f"/api/sessions/{unique}/stream"
    await create(stream, key)
    early = await push(gw, key, 0, 3)
    browsers = [Browser(gw.client, path) for _ in range(6)]
    await wait_until(lambda: all(len(b.got) == 3 for b in browsers), 10, "the replay")
    resumed = Browser(gw.client, path, last_id=early[1])  # a reconnect with Last-Event-ID
    live = await push(gw, key, 3, 3)
    await wait_until(lambda: all(len(b.got) == 6 for b in browsers), 10, "the live events")
    await wait_until(lambda: len(resumed.got) == 4, 10, "the resumed browser")
    assert stream.backend.subscribers == 1, "one subscription for the seven browsers"
    done = (await close(stream, key)).offset
    await asyncio.wait_for(asyncio.gather(*(b.task for b in [*browsers, resumed])), 20)
    for b in browsers:
        assert b.ids == early + live + [done]
        assert b.got == browsers[0].got
    assert resumed.ids == early[2:] + live + [done]
    assert resumed.got == browsers[0].got[2:]
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "the subscription to end")


async def test_a_browser_that_leaves_leaves_the_others_reading(
    stream: StreamHarness,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
) -> None:
    gw = await gateway_factory(stream)
    key, path = f"subagent:{unique}", f"/api/subagents/{unique}/stream"
    await create(stream, key)
    browsers = [Browser(gw.client, path) for _ in range(3)]
    early = await push(gw, key, 0, 1)
    await wait_until(lambda: all(len(b.got) == 1 for b in browsers), 10, "the first event")
    leaving, *staying = browsers
    leaving.leave.set()
    later = await push(gw, key, 1, 1)
    await asyncio.wait_for(leaving.task, 10)  # it left at the next event
    more = await push(gw, key, 2, 2)
    await wait_until(lambda: all(len(b.got) == 4 for b in staying), 10, "the others' events")
    assert stream.backend.subscribers == 1
    done = (await close(stream, key)).offset
    await asyncio.wait_for(asyncio.gather(*(b.task for b in staying)), 20)
    assert leaving.ids == early + later
    assert all(b.ids == early + later + more + [done] for b in staying)
    await wait_until(lambda: stream.backend.subscribers == 0, 5, "the subscription to end")


async def test_browsers_of_two_users_do_not_share(
    stream: StreamHarness,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
) -> None:
    """alice and bob each read their own buffer of the same kind: two subscriptions, each reads only
    its own; bob cannot read alice's even while she reads it."""
    gw = await gateway_factory(stream)
    bob_client = httpx.AsyncClient(
        base_url=gw.base_url, timeout=10.0, headers={"Authorization": f"Bearer {gw.keys['bob']}"}
    )
    try:
        mine, bobs = f"{unique}-a", f"{unique}-b"
        await create(stream, f"trace:{mine}", owner="alice")
        await create(stream, f"trace:{bobs}", owner="bob")
        alice = [Browser(gw.client, f"/api/sessions/{mine}/stream") for _ in range(2)]
        bob = [Browser(bob_client, f"/api/sessions/{bobs}/stream") for _ in range(2)]
        alices = await push(gw, f"trace:{mine}", 0, 1)
        bobs_ = await push(gw, f"trace:{bobs}", 5, 1)
        await wait_until(lambda: all(len(b.got) == 1 for b in alice + bob), 10, "the first events")
        assert stream.backend.subscribers == 2
        nosy = await bob_client.get(f"/api/sessions/{mine}/stream")
        assert nosy.status_code == 404
        alice_done = (await close(stream, f"trace:{mine}")).offset
        bob_done = (await close(stream, f"trace:{bobs}")).offset
        await asyncio.wait_for(asyncio.gather(*(b.task for b in alice + bob)), 20)
        assert all(b.ids == [*alices, alice_done] for b in alice)
        assert all(b.ids == [*bobs_, bob_done] for b in bob)
        assert bob[0].got[0][1]["reasoningDelta"] == "r5"
    finally:
        await bob_client.aclose()


async def test_a_restart_of_the_stream_service_reaches_every_browser(
    stream_factory: StreamFactory,  # noqa: F811
    gateway_factory: GatewayFactory,  # noqa: F811
    unique: str,
    request: pytest.FixtureRequest,
    signer: Signer,
) -> None:
    """The stream service stops and another comes up at its address: on Redis every browser reads on
    from where it was (each event once); on memory the buffer is gone and every browser's stream ends
    `interrupted`."""
    h = await stream_factory()
    gw = await gateway_factory(h)
    key, path = f"trace:{unique}", f"/api/sessions/{unique}/stream"
    await create(h, key)
    browsers = [Browser(gw.client, path) for _ in range(3)]
    early = await push(gw, key, 0, 2)
    await wait_until(lambda: all(len(b.got) == 2 for b in browsers), 10, "the first events")
    redis = isinstance(h.backend, RedisBackend)
    backend = the_same_buffers(h, request)
    await h.server.stop(1.0)
    again = await build(h.settings, h.server.target, backend, signer)
    await again.start()
    try:
        if redis:
            await asyncio.wait_for(h.channel.channel_ready(), 10)
            later = await push(gw, key, 2, 2)
            done = (await close(h, key)).offset
        await asyncio.wait_for(asyncio.gather(*(b.task for b in browsers)), 20)
    finally:
        await again.stop(1.0)
        await backend.aclose()
    for b in browsers:
        if redis:
            assert b.ids == early + later + [done]
        else:
            assert b.ids[:2] == early and [d["type"] for _, d in b.got[2:]] == ["error"]
            assert b.got[-1][1]["code"] == "interrupted", b.got[-1]
