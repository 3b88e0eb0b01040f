"""Many replicas on loopback, as the Kubernetes manifests run them: two gateways, two orchestrators, two
agent-runtimes and two stream services (Redis backend), one trace service, on one PostgreSQL and one
Redis, each its own process (`agentmesh serve`); every client balances round robin over the replicas'
addresses. One mesh, in order: turns spread over every replica (read from each process's /metrics,
where each also shows it froze its heap once it served), a cancel sent to gateway 1 stops a turn that
streams through gateway 2 and runs on the other orchestrator, a browser that loses gateway 1 mid-reply
resumes on gateway 2 with no gap, and killing one replica of each (gateway, orchestrator,
agent-runtime, stream) mid-traffic ends every reader's stream, loses no event a reader saw, leaves no
row pending, and the survivors take new turns."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentmesh.libs import events as evlib
from agentmesh.libs import identity
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.mesh import (
    TREE_RULE,
    ProcessMesh,
    SseReader,
    read_tree,
    sse_events,
    wait_live,
    wait_until,
)

LEASE_S = 2.0
WORDS = 60  # at 20 tokens a second: three seconds of text per run
RULES: dict[str, Any] = {
    "rules": [
        TREE_RULE,
        {"system": r"\[general\]", "after_tool": True, "text": "after " * WORDS, "tokens_per_second": 20},
        {"system": r"\[general\]", "user": "^long", "text": "long " * WORDS, "tokens_per_second": 20},
        {
            "system": r"\[general\]",
            "user": "^count",
            "text": "".join(f"w{i} " for i in range(WORDS)),
            "tokens_per_second": 30,
        },
        {"system": r"\[general\]", "text": "fine"},
        {"system": r"\[coder\]", "text": "callee " * 2 * WORDS, "tokens_per_second": 20},
        {"system": r"\[helper\]", "text": "subagent " * 2 * WORDS, "tokens_per_second": 20},
    ]
}
REPLICATED = ("gateway", "orchestrator", "agent-runtime", "stream")


# One mesh per test (it kills replicas), on PostgreSQL and Redis: what replicas share.
pytestmark = pytest.mark.mesh(
    backends=["postgres-redis"], scope="function", rules=RULES, lease_s=LEASE_S, replicas=2, metrics=True
)


async def series(mesh: ProcessMesh, name: str, metric: str, **labels: str) -> float:
    """The sum of the samples of `metric` process `name` exports whose labels include `labels`."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(mesh.metrics_url(name))).text
    want = labels.items()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == metric and want <= s.labels.items()
    )


async def handled(mesh: ProcessMesh, name: str, method: str) -> float:
    """How many RPCs `method` process `name` has served (for a gateway: POSTs of /api/chat)."""
    rpcs = await series(mesh, name, "agentmesh_grpc_server_handled_total", grpc_method=method)
    return rpcs + await series(mesh, name, "agentmesh_http_requests_total", route=method)


async def post_chat(mesh: ProcessMesh, gateway: str, message: str, session: str = "") -> httpx.Response:
    http = mesh.http(timeout=60, gateway=gateway)
    body = {"agent": "general", "message": message, **({"sessionId": session} if session else {})}
    resp = await http.send(http.build_request("POST", "/api/chat", json=body), stream=True)
    assert resp.status_code == 200, await resp.aread()
    resp.extensions["client"] = http  # closed with the response by `finish`
    return resp


async def finish(
    resp: httpx.Response, lines: AsyncIterator[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The rest of a POST's events (from `lines` when its reading began there); then closes it."""
    try:
        return [e async for e in (lines or sse_events(resp))]
    finally:
        await resp.aclose()
        await resp.extensions["client"].aclose()


async def test_replicas_share_the_work_and_survive_the_loss_of_one_of_each(process_mesh: ProcessMesh) -> None:
    mesh = process_mesh
    assert mesh.clients is not None
    # 1. Turns spread over the replicas: each gateway sends turns, each orchestrator's channel spreads
    # its runs over the runtimes, every process appends through either stream replica (the orchestrator
    # creating and closing each turn's buffer).
    served = {
        "gateway": ("/api/chat",),
        "orchestrator": ("RunTurn",),
        "agent-runtime": ("RunAgent",),
        "stream": ("CreateStream", "CloseStream"),
    }

    async def spread() -> bool:
        async def turn(gateway: str) -> list[dict[str, Any]]:
            return await finish(await post_chat(mesh, gateway, "hello"))

        for ended in await asyncio.gather(*(turn(f"gateway-{1 + i % 2}") for i in range(4))):
            assert ended[-1]["type"] == "done", ended[-3:]
        counts = {
            name: sum([await handled(mesh, name, method) for method in served[service]])
            for service in REPLICATED
            for name in mesh.names(service)
        }
        return all(counts.values())

    await wait_until(spread, 30, "every replica of every service to serve a turn")
    # Each process froze what it built before it served: a collection under load walks only what the
    # load made (docs/operations.md, "Garbage collection"). Its imports alone are tens of thousands.
    for name in mesh.instances:
        assert await series(mesh, name, "agentmesh_gc_frozen_objects") > 10_000, name

    # 2. A cancel sent to gateway 1 stops a turn streaming through gateway 2, run by the orchestrator
    # that did not take the cancel (both gateways' round robins move in step, one turn and one cancel
    # per try: a try that lands on one orchestrator is followed by one more call through gateway 1).
    crossed = False
    for _ in range(4):
        before = {o: await handled(mesh, o, "CancelTurn") for o in mesh.names("orchestrator")}
        resp = await post_chat(mesh, "gateway-2", "long reply please")
        head: list[dict[str, Any]] = []
        lines = sse_events(resp)
        async with asyncio.timeout(10):
            async for event in lines:
                head.append(event)
                if event["type"] == "text-delta":
                    break
        session = head[0]["traceId"]
        running = [o for o in mesh.names("orchestrator") if await in_flight(mesh, o, "RunTurn")]
        async with mesh.http(gateway="gateway-1") as http:
            cancelled = await http.post(f"/api/sessions/{session}/cancel")
        assert cancelled.status_code == 200 and cancelled.json() == {"cancelled": True}
        rest = await asyncio.wait_for(finish(resp, lines), 5)
        assert rest[-1]["type"] == "error" and rest[-1]["code"] == "cancelled", rest[-3:]
        text = "".join(e["textDelta"] for e in head + rest if e["type"] == "text-delta")
        assert len(text) < len("long " * WORDS)  # stopped before the model's reply was over
        with identity.acting_as(mesh.user):
            msgs = await mesh.clients.messages.ListMessages(ms.ListMessagesRequest(trace_id=session))
        assert msgs.messages[-1].status == tp.MESSAGE_STATUS_CANCELLED
        took = [o for o in mesh.names("orchestrator") if await handled(mesh, o, "CancelTurn") > before[o]]
        if running and took and running != took:
            crossed = True
            break
        async with mesh.http(gateway="gateway-1") as http:  # moves gateway 1's round robin on by one
            assert (await http.post("/api/sessions/no-such-session/cancel")).status_code == 404
    assert crossed, "the cancel never reached the orchestrator that was not running the turn"

    # 3. A browser reading a reply from gateway 1 loses its connection and resumes on gateway 2 with
    # Last-Event-ID: every word once, in order.
    first = await post_chat(mesh, "gateway-1", "count for me")
    deltas = 0

    def drop_after_five(event: dict[str, Any]) -> bool:
        nonlocal deltas
        if event["type"] == "start":
            reader.path = f"/api/sessions/{event['traceId']}/stream"
        deltas += event["type"] == "text-delta"
        return deltas == 5

    reader = SseReader(
        lambda: mesh.http(gateway="gateway-2"), "", first=first, reconnect=True, on_event=drop_after_five
    )
    await asyncio.wait_for(reader.task, 20)
    await first.extensions["client"].aclose()
    assert reader.connections == 2 and reader.last == "done", reader.events[-3:]
    assert reader.text == "".join(f"w{i} " for i in range(WORDS))
    offsets = [e["_id"] for e in reader.events if e.get("_id")]
    assert offsets == sorted(offsets, key=lambda o: tuple(int(p) for p in o.split("-"))), offsets
    assert len(set(offsets)) == len(offsets)

    # 4. Mid-traffic, one replica of each replicated service dies. Readers follow every key of every
    # turn's tree through whichever gateway is up, as a browser behind a load balancer would.
    async def tree(gateway: str) -> tuple[httpx.Response, str, str, str]:
        """Starts a turn whose callee and subagent are running; returns (post, session, task, subagent)."""
        post = await post_chat(mesh, gateway, "tree of calls")
        task_id = sub_id = session = ""
        async with asyncio.timeout(20):
            async for event in sse_events(post):
                if event["type"] == "start":
                    session = event["traceId"]
                task_id = event.get("taskId", task_id)
                if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                    sub_id = event["subagent"]["id"]
                if task_id and sub_id:
                    break
        return post, session, task_id, sub_id

    trees = await asyncio.gather(*(tree(f"gateway-{1 + i % 2}") for i in range(4)))
    readers: list[tuple[SseReader, str]] = []  # every one reads through gateway-1 (the first up)
    for _, session, task_id, sub_id in trees:
        for path, key in (
            (f"/api/sessions/{session}/stream", f"trace:{session}"),
            (f"/api/agents/a2a/stream?taskId={task_id}", f"a2a:{task_id}"),
            (f"/api/subagents/{sub_id}/stream", f"subagent:{sub_id}"),
        ):
            readers.append((SseReader(lambda: mesh.http(timeout=60, gateway=""), path, reconnect=True), key))
    # The callees' and subagents' text is flowing (the sessions' own text comes after their tools).
    children = [r for r, key in readers if not key.startswith("trace:")]
    await wait_live(children, 15)
    await wait_until(lambda: all(r.events for r, _ in readers), 10, "every reader to be reading")
    sessions = {session for _, session, _, _ in trees}
    assert not [key for r, key in readers if r.ended]  # all of them mid-stream

    await asyncio.gather(*(mesh.kill(f"{service}-1") for service in REPLICATED))
    async with asyncio.timeout(25):
        await asyncio.gather(*(r.task for r, _ in readers))
    for post, *_ in trees:
        with contextlib.suppress(httpx.HTTPError):
            await post.aclose()
        await post.extensions["client"].aclose()
    for reader, key in readers:
        assert reader.last in ("done", "error"), (key, reader.events[-3:])
        assert reader.connections >= 2, key  # gateway-1 died under it: it resumed on gateway-2

    # Nothing a reader saw is missing from its buffer (Redis kept every acknowledged event).
    for reader, key in readers:
        with identity.acting_as(mesh.user):
            follow = mesh.clients.follows.follow(key)
        async with asyncio.timeout(10):
            stored = [evlib.to_dict(e, with_offset=True) async for e in follow]
        by_offset = {e["offset"]: e for e in stored}
        for seen in reader.events:
            if seen.get("_id") and seen["type"] != "text-delta":
                assert by_offset[seen["_id"]]["type"] == seen["type"], (key, seen)
        seen_text = reader.text
        stored_text = "".join(e["textDelta"] for e in stored if e["type"] == "text-delta")
        assert stored_text.startswith(seen_text), key
        if reader.last == "done":
            assert seen_text == stored_text, key  # the whole reply: no gap, nothing twice

    # No orphan: every row of every tree is settled (the survivors' reaper and stream lease sweep).
    async def settled() -> bool:
        for session in sessions:
            tree = await read_tree(mesh, session)
            if tree is None or tree.open_rows:
                return False
        return True

    await wait_until(settled, LEASE_S * 6, "every tree settled after the kills")

    # The survivors take new turns.
    async def new_turn() -> bool:
        with contextlib.suppress(httpx.HTTPError, AssertionError):
            ended = await finish(await post_chat(mesh, "gateway-2", "hello again"))
            return ended[-1]["type"] == "done"
        return False

    await wait_until(new_turn, LEASE_S * 6, "a new turn through the surviving replicas")


async def in_flight(mesh: ProcessMesh, name: str, method: str) -> float:
    return await series(mesh, name, "agentmesh_grpc_server_in_flight", grpc_method=method)
