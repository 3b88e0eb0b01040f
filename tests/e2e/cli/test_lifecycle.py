"""Health, graceful shutdown, and `agentmesh up` as a user runs it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentmesh.mock_llm import MockLLM
from tests.mesh import TEST_CATALOG, TREE_RULE, Mesh, Ports, log_file, process_env, sse_events, wait_until

SERVICES = {
    "trace": "agentmesh.trace.v1.TraceService",
    "stream": "agentmesh.stream.v1.StreamService",
    "agent-runtime": "agentmesh.runtime.v1.AgentRuntimeService",
    "orchestrator": "agentmesh.orchestrator.v1.OrchestratorService",
}
# The other services of the trace process (each has its own health status too).
TRACE_SERVICES = [f"agentmesh.trace.v1.{s}Service" for s in ("Message", "Task", "Subagent")] + [
    "agentmesh.agents.v1.AgentService",
    "agentmesh.auth.v1.AuthService",
    "agentmesh.leases.v1.LeaseService",
]


# A mesh per test: the tests stop it.
pytestmark = pytest.mark.mesh(
    scope="function", rules={"rules": [], "default": {"text": "word " * 200, "tokens_per_second": 100}}
)


async def health(target: str, service: str) -> int:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=2
        )
        return int(resp.status)


async def test_every_service_reports_serving(mesh: Mesh) -> None:
    for name, service in SERVICES.items():
        server = mesh.servers[name]
        assert await health(server.target, service) == health_pb2.HealthCheckResponse.SERVING
        assert await health(server.target, "") == health_pb2.HealthCheckResponse.SERVING
    for service in TRACE_SERVICES:
        assert await health(mesh.servers["trace"].target, service) == health_pb2.HealthCheckResponse.SERVING
    async with mesh.http() as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}


async def test_graceful_shutdown_with_a_stream_in_flight(mesh: Mesh) -> None:
    orchestrator = mesh.servers["orchestrator"]
    async with (
        mesh.http(timeout=20) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": "long one"}) as resp,
    ):
        got = []
        stream = sse_events(resp)
        statuses: list[int] = []
        async with asyncio.timeout(15), grpc.aio.insecure_channel(orchestrator.target) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=SERVICES["orchestrator"])
            )
            statuses.append((await watch.read()).status)
            async for event in stream:
                got.append(event)
                if event["type"] == "text-delta":
                    break
            stopping = asyncio.create_task(orchestrator.stop(grace_s=0.5))
            statuses.append((await watch.read()).status)  # the next status a watcher sees
            async for event in stream:
                got.append(event)
            await stopping
    assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
    # The client saw a clean end or a clear error, never a hang.
    assert got[-1]["type"] in ("done", "error"), got[-1]
    if got[-1]["type"] == "error":
        assert got[-1]["code"] and got[-1]["message"]


@pytest.fixture
def ports() -> Iterator[Ports]:
    held = Ports()
    yield held
    held.release()


def _env(tmp: Path, ports: Ports) -> dict[str, str]:
    return process_env(tmp, ports, AGENTMESH_SHUTDOWN_GRACE_S="2", AGENTMESH_MOCK_PORT=str(ports.take()))


async def test_serve_drains_and_exits_on_sigterm(tmp_path: Path, ports: Ports) -> None:
    env = _env(tmp_path, ports)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", "serve", "trace", env=env, stderr=asyncio.subprocess.PIPE
    )
    try:
        from agentmesh.libs.rpc import wait_serving

        await wait_serving(env["AGENTMESH_ADDRESSES__TRACE"], timeout_s=30)
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    logs = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    assert any(line.get("msg") == "serving" and line.get("service") == "trace" for line in lines), logs


def db_rows(data_dir: Path, sql: str) -> list[Any]:
    db = sqlite3.connect(data_dir / "agentmesh.db")
    try:
        return db.execute(sql).fetchall()
    finally:
        db.close()


async def _up(env: dict[str, str], *extra: str) -> tuple[asyncio.subprocess.Process, str, str]:
    """`agentmesh up` as a user starts it; returns once it printed its URL and key."""
    log = log_file(Path(env["AGENTMESH_DATA_DIR"]) / "up.log")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", "up", "--mock-port", env["AGENTMESH_MOCK_PORT"], *extra,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
    )  # fmt: skip
    log.close()
    url = key = ""
    assert proc.stdout is not None
    async with asyncio.timeout(60):
        while not key:
            line = (await proc.stdout.readline()).decode()
            assert line, "agentmesh up exited before it was ready"
            if "agentmesh is up at" in line:
                url = line.split("at", 1)[1].strip()
            if "development API key" in line:
                key = line.rsplit(":", 1)[1].strip()
    return proc, url, key


async def test_agentmesh_up_streams_a_reply_and_stops_everything(tmp_path: Path, ports: Ports) -> None:
    env = _env(tmp_path, ports)
    proc, url, key = await _up(env)
    try:
        assert url == f"http://127.0.0.1:{env['AGENTMESH_GATEWAY_PORT']}"
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:
            async with http.stream(
                "POST", "/api/chat", json={"agent": "general", "message": "hello"}
            ) as resp:
                assert resp.status_code == 200, await resp.aread()
                events = [e async for e in sse_events(resp)]
        assert events[0]["type"] == "start" and events[-1]["type"] == "done"
        assert "You said" in "".join(e.get("textDelta", "") for e in events)
        # `agentmesh chat` streams the same to a terminal.
        chat_proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agentmesh.cli",
            "chat",
            "--agent",
            "coder",
            "--api-key",
            key,
            "--url",
            url,
            "fizzbuzz",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(chat_proc.communicate(), 30)
        assert chat_proc.returncode == 0 and "fizzbuzz" in out.decode()
        # `agentmesh keys create` prints a new key once; it works at the gateway.
        keys = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agentmesh.cli",
            "keys",
            "create",
            "--user",
            "bob",
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        bob_key = (await asyncio.wait_for(keys.communicate(), 30))[0].decode().strip()
        assert keys.returncode == 0 and bob_key.startswith("am_") and bob_key != key
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {bob_key}"}) as http:
            assert (await http.get("/api/sessions")).json()["sessions"] == []  # alice's session is not bob's
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        # Every child is gone: the gateway port no longer answers.
        with pytest.raises(httpx.ConnectError):
            async with httpx.AsyncClient(base_url=url) as http:
                await http.get("/healthz")
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()


async def test_metrics_count_requests_by_route(mesh: Mesh) -> None:
    async with mesh.http() as http:
        await http.get("/api/sessions")
        await http.get("/api/sessions/nope")
        async with http.stream("POST", "/api/chat", json={"agent": "general", "message": "hi"}) as resp:
            [e async for e in sse_events(resp)]
        body = (await http.get("/metrics")).text
    assert 'agentmesh_http_requests_total{method="GET",route="/api/sessions",status="200"} 1.0' in body
    assert (
        'agentmesh_http_requests_total{method="GET",route="/api/sessions/{session_id}",status="404"} 1.0'
        in body
    )
    assert 'agentmesh_http_requests_total{method="POST",route="/api/chat",status="200"} 1.0' in body
    assert "agentmesh_http_open_streams 0.0" in body  # the finished SSE response was counted down


async def test_up_killed_leaves_no_orphans(tmp_path: Path, ports: Ports) -> None:
    proc, _, _ = await _up(_env(tmp_path, ports))
    children = psutil.Process(proc.pid).children()
    assert len(children) == 6
    proc.kill()  # SIGKILL: `up` cannot clean up, the kernel tells the children
    await proc.wait()
    _gone, alive = await asyncio.to_thread(psutil.wait_procs, children, timeout=20)
    assert not alive, [p.cmdline() for p in alive]


def named_children(pid: int) -> dict[str, psutil.Process]:
    """`up`'s live children by what they run: mock-llm, trace, stream, agent-runtime, orchestrator,
    gateway."""
    out = {}
    for child in psutil.Process(pid).children():
        with contextlib.suppress(psutil.Error):
            cmd = child.cmdline()
            if child.status() != psutil.STATUS_ZOMBIE and "agentmesh.cli" in cmd:
                rest = cmd[cmd.index("agentmesh.cli") + 1 :]
                out[rest[1] if rest[0] == "serve" else rest[0]] = child
    return out


async def test_up_restarts_a_child_that_died_and_the_rest_keeps_serving(tmp_path: Path, ports: Ports) -> None:
    env = _env(tmp_path, ports)
    proc, url, key = await _up(env)
    try:
        children = named_children(proc.pid)
        gateway_pid = children["gateway"].pid
        children["stream"].kill()  # SIGKILL one child

        def restarted() -> bool:
            now = named_children(proc.pid)
            return "stream" in now and now["stream"].pid != children["stream"].pid

        await wait_until(restarted, 15, "`up` to restart the stream service")
        assert "stream exited with -9; restarting" in (tmp_path / "up.log").read_text()
        assert proc.returncode is None, "`up` keeps running"
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:

            async def serves() -> bool:
                async with http.stream(
                    "POST", "/api/chat", json={"agent": "general", "message": "hi"}
                ) as resp:
                    return (
                        resp.status_code == 200 and [e async for e in sse_events(resp)][-1]["type"] == "done"
                    )

            await wait_until(serves, 15, "a chat turn through the restarted stream service")
        assert named_children(proc.pid)["gateway"].pid == gateway_pid, "the others kept serving"
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


async def test_sigterm_ends_every_live_stream_with_a_terminal_event_within_the_grace(
    tmp_path: Path, ports: Ports
) -> None:
    """20 clients follow slow replies (one of them a trace API `/run`, four of them trees: a callee and
    a subagent batch under them, streaming); `up` is told to stop: each gets a last event (`shutdown`,
    with how to resume, or `done`) before its connection closes, within the grace; no turn, task or
    subagent is left pending or running: each was settled as interrupted before its process exited."""
    slow = {"text": "slow " * 400, "tokens_per_second": 20}
    mock = MockLLM(
        {
            "rules": [
                TREE_RULE,
                {"system": r"\[coder\]", **slow},
                {"system": r"\[helper\]", **slow},
            ],
            "default": slow,
        }
    )
    await mock.start()
    env = _env(tmp_path, ports)
    env.update(
        AGENTMESH_LLM__BASE_URL=mock.base_url,
        AGENTMESH_SHUTDOWN_GRACE_S="3",
        AGENTMESH_CATALOG=str(TEST_CATALOG),
    )
    proc, url, key = await _up(env, "--no-mock-llm")
    try:
        clients: list[list[dict[str, Any]]] = [[] for _ in range(20)]
        live = [asyncio.Event() for _ in clients]

        async def read(i: int, resp: httpx.Response) -> None:
            assert resp.status_code == 200
            async for event in sse_events(resp):
                clients[i].append(event)
                if event["type"] in ("text-delta", "subagent-update"):  # a tree: its children stream
                    live[i].set()

        async def follow(i: int) -> None:
            async with httpx.AsyncClient(
                base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60
            ) as http:
                if i == 0:  # the trace API's run: a trace (its first turn cancelled), then its SSE /run
                    async with http.stream(
                        "POST", "/api/chat", json={"agent": "general", "message": "x"}
                    ) as r:
                        async for event in sse_events(r):
                            if event["type"] == "start":
                                trace = event["traceId"]
                                assert (await http.post(f"/api/sessions/{trace}/cancel")).status_code == 200
                    run = f"/api/traces/{trace}/run"
                    headers = {"Accept": "text/event-stream"}
                    async with http.stream("POST", run, json={"input": "slow 0"}, headers=headers) as resp:
                        await read(i, resp)
                    return
                message = f"tree {i}" if i % 5 == 1 else f"slow {i}"
                async with http.stream(
                    "POST", "/api/chat", json={"agent": "general", "message": message}
                ) as r:
                    await read(i, r)

        readers = [asyncio.create_task(follow(i)) for i in range(len(clients))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in live)), 30)
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(asyncio.gather(*readers), 3 + 5)  # within the grace (and a margin)
        ended = time.monotonic() - stopping
        for events_ in clients:
            last = events_[-1]
            assert last["type"] in ("done", "error"), events_[-2:]
            if last["type"] == "error":
                assert last["code"] == "shutdown" and "resume" in last["message"], last
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert ended < 8
        db = sqlite3.connect(tmp_path / "agentmesh.db")
        try:
            pending = db.execute("SELECT count(*) FROM messages WHERE status = 'pending'").fetchone()[0]
            interrupted = db.execute(
                "SELECT count(*) FROM messages WHERE metadata LIKE '%interrupted%'"
            ).fetchone()[0]
            running = db.execute(
                "SELECT count(*) FROM subagent_sessions WHERE status IN ('queued', 'running')"
            ).fetchone()[0]
            tasks = db.execute(
                "SELECT count(*) FROM a2a_tasks WHERE state IN ('submitted', 'working')"
            ).fetchone()[0]
        finally:
            db.close()
        assert pending == 0, "every turn completed within the grace or was settled as interrupted"
        statuses = db_rows(tmp_path, "SELECT status, metadata FROM messages WHERE role = 'assistant'")
        assert interrupted >= 20, statuses  # the chats' and their callees' and subagents' turns
        assert (running, tasks) == (0, 0), "every subagent row and task settled with its turn"
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        await mock.stop()
