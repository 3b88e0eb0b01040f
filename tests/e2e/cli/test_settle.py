"""A process SIGKILLed mid-turn and restarted at once, as `agentmesh up` does, each process of the mesh
its own (`agentmesh serve`), a turn with an agent-invoke callee and a subagent streaming at a user's
pace: whoever learns of the death settles the tree within seconds, long before the lease; a restarted
stream service loses no turn on Redis (docs/design/streams.md#reconnects). On SQLite + memory and
PostgreSQL + Redis. (Services killed for good: test_faults.py.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.e2e.cli.test_faults import BOUND_S, LEASE_S, RULES, WORDS, follow, settled
from tests.mesh import BACKENDS, ProcessMesh, SseReader, read_tree, sse_events, wait_live, wait_until

# A mesh per test, with short leases but where a test says otherwise.
pytestmark = pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES, lease_s=LEASE_S)


@pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES)  # the default lease (30 s)
@pytest.mark.parametrize("victim", ["orchestrator", "agent-runtime", "trace"])
async def test_a_process_killed_mid_turn_is_settled_in_seconds(
    process_mesh: ProcessMesh, victim: str
) -> None:
    """SIGKILL of a process running a tree's turns (a callee and a subagent streaming at 20 tokens/s),
    restarted at once as `agentmesh up` would: whoever learns it settles the tree — the orchestrator
    whose runs' calls broke (a runtime died), or the runtimes whose runs' caller vanished (the
    orchestrator died: they end the buffers and have the restarted orchestrator settle the rows); the
    trace service dying leaves no run without its process, and the tree's rows and cards end. Every
    reader of every key gets its terminal event within 5 s of the kill, and every row is settled within
    5 s too — long before the 30 s lease."""
    mesh = process_mesh
    async with mesh.http(timeout=60) as http:
        post = await http.send(
            http.build_request("POST", "/api/chat", json={"agent": "general", "message": "tree"}), stream=True
        )
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
        loop = asyncio.get_running_loop()
        killed = loop.time()  # (the readers' `_t` is on the same monotonic clock)
        await mesh.kill(victim)
        restart = asyncio.create_task(mesh.start(victim))  # as `agentmesh up` restarts it, meanwhile
        settling = asyncio.create_task(wait_until(lambda: settled(mesh, session), BOUND_S, "the tree"))
        # A run's own process died: its readers end `error` within 5 s. The trace service died: no run
        # lost its process, so the runs go on to their end (their writes wait for the restarted one).
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*(r.task for r in readers))
        waited = max(r.end["_t"] for r in readers) - killed
        await restart
        back = loop.time()  # the restarted process serves (its start is slow on a loaded machine)
        await settling
        settled_at = loop.time()
        await post.aclose()
    ends = ("done", "error") if victim == "trace" else ("error",)
    for reader in readers:
        assert reader.end.get("type") in ends, (reader.path, reader.events[-3:])
    assert victim == "trace" or waited < 5, waited
    tree = await read_tree(mesh, session)
    assert tree is not None and not tree.open_rows, tree.open_rows if tree else "no tree"
    # Every row and card ends within 5 s: of the kill when the caller settles them (a runtime died),
    # of the restart when the restarted process does (an orchestrator: EndOrphanedTurn; the trace
    # service: the runs' own writes, once they ended).
    since = {"agent-runtime": killed, "orchestrator": back}.get(victim, max(back, killed + waited))
    assert settled_at - since < 5, (victim, settled_at - since)


async def test_a_stream_service_restarted_mid_turn(process_mesh: ProcessMesh) -> None:
    """SIGKILL of the stream service mid-turn, restarted at once as `agentmesh up` would. On Redis the
    buffers outlive it: every writer and reader reconnects and goes on from its offset, so each reader
    of the tree ends `done` with its run's whole text exactly once. On the memory backend the buffers
    died with it: each reader ends with a clear `interrupted` and the tree is settled."""
    mesh = process_mesh
    on_redis = mesh.env.get("AGENTMESH_STREAM__BACKEND") == "redis"
    async with mesh.http(timeout=60) as http:
        post = await http.send(
            http.build_request("POST", "/api/chat", json={"agent": "general", "message": "tree"}), stream=True
        )
        lines = sse_events(post)
        task_id = sub_id = session = ""
        async with asyncio.timeout(20):
            async for event in lines:
                session = session or event["traceId"]
                task_id = event.get("taskId", task_id)
                if event["type"] == "subagent-update" and event["subagent"]["status"] == "running":
                    sub_id = event["subagent"]["id"]
                if task_id and sub_id:
                    break
        readers = [
            follow(mesh, f"/api/sessions/{session}/stream"),
            follow(mesh, f"/api/agents/a2a/stream?taskId={task_id}"),
            follow(mesh, f"/api/subagents/{sub_id}/stream"),
        ]
        await wait_live(readers[1:], 15)
        await mesh.kill("stream")
        await mesh.start("stream")
        async with asyncio.timeout(BOUND_S):
            await asyncio.gather(*(r.task for r in readers))
        await post.aclose()

    def text(reader: SseReader) -> str:
        return "".join(e["textDelta"] for e in reader.events if e["type"] == "text-delta")

    if on_redis:
        for reader in readers:
            assert reader.end.get("type") == "done", (reader.path, reader.events[-3:])
        assert text(readers[1]) == "callee " * WORDS
        assert text(readers[2]) == "subagent " * WORDS
        assert text(readers[0]).endswith("after " * WORDS)
    else:
        for reader in readers:
            assert reader.end.get("code") == "interrupted", (reader.path, reader.events[-3:])
    await wait_until(lambda: settled(mesh, session), LEASE_S * 6, "the tree settled")
