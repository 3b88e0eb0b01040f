"""Whatever dies, every stream ends and nothing stays pending. Each service runs as its own process
(`agentmesh serve`); a turn with an agent-invoke callee and a subagent streams at a user's pace; one
service is SIGKILLed mid-turn. Then: every reader of every key of the tree gets a terminal event within
a bound (through a restarted gateway when the gateway is the one that died), the restarted service's
orphans are settled within the lease time, the session takes a new turn, and on Redis nothing a
reader saw before the kill is missing from the buffer. On SQLite + memory and PostgreSQL + Redis.
(A process restarted at once, settled in seconds, and a stream-service restart: test_settle.py.)"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from agentmesh.libs import events as evlib
from agentmesh.libs import identity
from tests.mesh import (
    BACKENDS,
    TREE_RULE,
    ProcessMesh,
    SseReader,
    read_tree,
    sse_events,
    wait_live,
    wait_until,
)

LEASE_S = 2.0
BOUND_S = 25.0  # the longest a reader may wait for its terminal event
WORDS = 80  # at 20 tokens a second: four seconds of text per run
RULES: dict[str, Any] = {
    "rules": [
        TREE_RULE,
        {"system": r"\[general\]", "after_tool": True, "text": "after " * WORDS, "tokens_per_second": 20},
        {"system": r"\[general\]", "text": "fine", "tokens_per_second": 50},
        {"system": r"\[coder\]", "text": "callee " * WORDS, "tokens_per_second": 20},
        {"system": r"\[helper\]", "text": "subagent " * WORDS, "tokens_per_second": 20},
    ]
}


# A mesh per test: each kills one of its services (the stream service for good: its writers and readers
# give up on it after 3 s, not the default 15 s of a restart's budget).
pytestmark = pytest.mark.mesh(
    backends=BACKENDS,
    scope="function",
    rules=RULES,
    lease_s=LEASE_S,
    extra_env={"AGENTMESH_STREAM__RECONNECT_S": "3"},
)


def follow(mesh: ProcessMesh, path: str) -> SseReader:
    return SseReader(lambda: mesh.http(timeout=60), path, reconnect=True)


async def settled(mesh: ProcessMesh, session: str) -> bool:
    """No row of the tree is still pending, working or running (and the tree has its task and card)."""
    tree = await read_tree(mesh, session)
    return tree is not None and not tree.open_rows and bool(tree.tasks and tree.subagents)


@dataclass
class LiveTree:
    """A "tree" turn under way: its POST /api/chat, the rest of that response's events, its events so
    far, its ids, and a reader of each key of the tree streaming live (session, callee task, subagent)."""

    post: httpx.Response
    lines: AsyncIterator[dict[str, Any]]
    head: list[dict[str, Any]]
    session: str
    task_id: str
    sub_id: str
    readers: list[SseReader]


async def begin_tree(mesh: ProcessMesh, http: httpx.AsyncClient) -> LiveTree:
    """POST /api/chat "tree" (a callee and a subagent at 20 tokens/s), read until both run, and follow
    each key of the tree until it streams."""
    post = await http.send(
        http.build_request("POST", "/api/chat", json={"agent": "general", "message": "tree"}), stream=True
    )
    assert post.status_code == 200
    lines = sse_events(post)
    head: list[dict[str, Any]] = []
    task_id = sub_id = ""
    async with asyncio.timeout(20):
        async for event in lines:
            head.append(event)
            task_id = event.get("taskId", task_id)
            if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                sub_id = event["subagent"]["id"]
            if task_id and sub_id:
                break
    session = head[0]["traceId"]
    readers = [
        follow(mesh, f"/api/sessions/{session}/stream"),
        follow(mesh, f"/api/agents/a2a/stream?taskId={task_id}"),
        follow(mesh, f"/api/subagents/{sub_id}/stream"),
    ]
    await wait_live(readers[1:], 15)
    return LiveTree(post, lines, head, session, task_id, sub_id, readers)


@pytest.mark.parametrize("victim", ["trace", "stream", "agent-runtime", "orchestrator", "gateway"])
async def test_a_service_killed_mid_turn_leaves_no_stream_open_and_nothing_pending(
    process_mesh: ProcessMesh, victim: str
) -> None:
    mesh = process_mesh
    async with mesh.http(timeout=60) as http:
        tree = await begin_tree(mesh, http)
        post, lines, head, readers = tree.post, tree.lines, tree.head, tree.readers
        session, task_id, sub_id = tree.session, tree.task_id, tree.sub_id

        await mesh.kill(victim)
        if victim == "gateway":
            await mesh.start(victim)  # the readers reconnect to it and resume
        async with asyncio.timeout(BOUND_S):
            with contextlib.suppress(httpx.HTTPError):
                async for (
                    event
                ) in lines:  # the POST itself ends with a terminal event too (but the gateway's death)
                    head.append(event)
            await asyncio.gather(*(r.task for r in readers))
        await post.aclose()
    for reader in readers:
        assert reader.end.get("type") in ("done", "error"), (victim, reader.path, reader.events[-3:])
    if victim != "gateway":
        assert head[-1]["type"] in ("done", "error"), (victim, head[-3:])
        await mesh.start(victim)

    # The restarted service's orphans (and every row of the tree) are settled within the lease time.
    await wait_until(lambda: settled(mesh, session), LEASE_S * 6, f"the tree settled after {victim} died")

    # Nothing a reader saw is missing from a buffer that outlived the kill (Redis keeps them).
    if mesh.env.get("AGENTMESH_STREAM__BACKEND") == "redis":
        assert mesh.clients is not None
        for reader, key in zip(
            readers, (f"trace:{session}", f"a2a:{task_id}", f"subagent:{sub_id}"), strict=True
        ):
            with identity.acting_as(mesh.user):
                buffer = mesh.clients.follows.follow(key)
            async with asyncio.timeout(10):
                stored = [evlib.to_dict(e, with_offset=True) async for e in buffer]
            by_offset = {e["offset"]: e for e in stored}
            for seen in reader.events:  # every stored event seen (text deltas merge differently per read)
                if seen.get("_id") and seen["type"] != "text-delta":
                    assert by_offset[seen["_id"]]["type"] == seen["type"], (key, seen)
            seen_text = "".join(e["textDelta"] for e in reader.events if e["type"] == "text-delta")
            stored_text = "".join(e["textDelta"] for e in stored if e["type"] == "text-delta")
            assert stored_text.startswith(seen_text), key

    # The session takes a new turn (once the dead turn's buffer was ended, by its lease if need be).
    async def new_turn() -> list[dict[str, Any]] | None:
        async with mesh.http() as http:
            async with http.stream(
                "POST", "/api/chat", json={"agent": "general", "message": "again", "sessionId": session}
            ) as resp:
                if resp.status_code in (409, 503):  # the old buffer not ended yet, a channel reconnecting
                    return None
                assert resp.status_code == 200, await resp.aread()
                got = [e async for e in sse_events(resp)]
                return None if got[-1].get("code") == "unavailable" else got

    again = await wait_until(new_turn, LEASE_S * 6, "the session to take a new turn")
    assert again[-1]["type"] == "done", again[-3:]
