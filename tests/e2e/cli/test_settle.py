"""A process SIGKILLed mid-turn and restarted at once, as `agentmesh up` does, each process of the mesh
its own (`agentmesh serve`), a turn with an agent-invoke callee and a subagent streaming at a user's
pace: whoever learns of the death settles the tree within seconds, long before the lease; a restarted
stream service loses no turn on Redis (docs/design/streams.md#reconnects). On SQLite + memory and
PostgreSQL + Redis. (Services killed for good: test_faults.py.)"""

from __future__ import annotations

import asyncio

import pytest

from tests.e2e.cli.test_faults import BOUND_S, LEASE_S, RULES, WORDS, begin_tree, settled
from tests.mesh import BACKENDS, ProcessMesh, SseReader, read_tree, wait_until

DEFAULT_LEASE_S = 30.0  # the settings' default (libs/config.py)
SOON_S = 10.0  # a third of the default lease: what settles by then was settled by knowledge

# A mesh per test, with short leases but where a test says otherwise.
pytestmark = pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES, lease_s=LEASE_S)


@pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES, lease_s=DEFAULT_LEASE_S)
@pytest.mark.parametrize("victim", ["orchestrator", "agent-runtime", "trace"])
async def test_a_process_killed_mid_turn_is_settled_in_seconds(
    process_mesh: ProcessMesh, victim: str
) -> None:
    """SIGKILL of a process running a tree's turns (a callee and a subagent streaming at 20 tokens/s),
    restarted at once as `agentmesh up` would: whoever learns it settles the tree — the orchestrator
    whose runs' calls broke (a runtime died), or the runtimes whose runs' caller vanished (the
    orchestrator died: they end the buffers and have the restarted orchestrator settle the rows); the
    trace service dying leaves no run without its process, and the tree's rows and cards end. Every
    reader of every key gets its terminal event, and every row and card is settled, within a third of
    the 30 s lease: by knowledge, not by the lease. (The 5 s target is measured by `make chaos`, which
    reports the longest wait; a timed assertion here would measure the load of the machine.)"""
    mesh = process_mesh
    async with mesh.http(timeout=60) as http:
        tree = await begin_tree(mesh, http)
        post, session, readers = tree.post, tree.session, tree.readers
        loop = asyncio.get_running_loop()
        killed = loop.time()  # (the readers' `_t` is on the same monotonic clock)
        await mesh.kill(victim)
        restart = asyncio.create_task(mesh.start(victim))  # as `agentmesh up` restarts it, meanwhile
        settling = asyncio.create_task(wait_until(lambda: settled(mesh, session), BOUND_S, "the tree"))
        # A run's own process died: its readers end `error` at once. The trace service died: no run
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
    assert victim == "trace" or waited < SOON_S, waited
    stored = await read_tree(mesh, session)
    assert stored is not None and not stored.open_rows, stored.open_rows if stored else "no tree"
    # Every row and card ends soon: after the kill when the caller settles them (a runtime died),
    # of the restart when the restarted process does (an orchestrator: EndOrphanedTurn; the trace
    # service: the runs' own writes, once they ended).
    since = {"agent-runtime": killed, "orchestrator": back}.get(victim, max(back, killed + waited))
    assert settled_at - since < SOON_S, (victim, settled_at - since)


@pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES, lease_s=DEFAULT_LEASE_S)
async def test_a_stream_service_restarted_mid_turn(process_mesh: ProcessMesh) -> None:
    """SIGKILL of the stream service mid-turn, restarted at once as `agentmesh up` would (well within
    the buffers' lease: a restart that outlasts it ends them `interrupted`). On Redis the buffers
    outlive it: every writer and reader reconnects and goes on from its offset, so each reader
    of the tree ends `done` with its run's whole text exactly once. On the memory backend the buffers
    died with it: each reader ends with a clear `interrupted` and the tree is settled."""
    mesh = process_mesh
    on_redis = mesh.env.get("AGENTMESH_STREAM__BACKEND") == "redis"
    async with mesh.http(timeout=60) as http:
        tree = await begin_tree(mesh, http)
        post, session, readers = tree.post, tree.session, tree.readers
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
