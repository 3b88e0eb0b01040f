"""`make bench`: what the mesh adds to a streamed reply.

Scenario 1: a 2,000-token reply at the scripted model server's top speed, read (a) by an SSE client
through the whole mesh (`agentmesh up`: gateway -> orchestrator -> agent-runtime -> openai client
-> model server, every delta appended to the stream service and relayed back) and (b) by the
`openai` client straight from the same model server, in the same run, interleaved turn by turn.
Prints and writes tests/bench/results/latest.json: completion-time ratio (mesh / direct) and the
time to first delta the mesh adds (p50, p99).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from openai import AsyncOpenAI

from tests.mesh import free_port, process_env

RESULTS = Path(__file__).parent / "results" / "latest.json"
RULES = {"ttft_ms": 0, "tokens_per_second": 0, "rules": [], "default": {"tokens": 2000}}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def through_mesh(http: httpx.AsyncClient) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = 0.0
    chars = 0
    async with http.stream("POST", "/api/chat", json={"agent": "general", "message": "bench"}) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if event["type"] == "text-delta":
                if not first:
                    first = time.perf_counter() - start
                chars += len(event["textDelta"])
            elif event["type"] in ("done", "error"):
                assert event["type"] == "done", event
                break
    return first, time.perf_counter() - start, chars


async def direct(client: AsyncOpenAI) -> tuple[float, float, int]:
    start = time.perf_counter()
    first = 0.0
    chars = 0
    stream = await client.chat.completions.create(
        model="mock-gpt",
        messages=[{"role": "user", "content": "bench"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=4096,
    )
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:
                if not first:
                    first = time.perf_counter() - start
                chars += len(choice.delta.content)
    return first, time.perf_counter() - start, chars


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "system": platform.platform(),
    }


def start_mesh() -> tuple[subprocess.Popen[str], dict[str, int], str]:
    """`agentmesh up` on free loopback ports with a fresh SQLite file; returns (process, ports, key)."""
    data = Path(".agentmesh/bench")
    data.mkdir(parents=True, exist_ok=True)
    (data / "agentmesh.db").unlink(missing_ok=True)
    env = process_env(data, AGENTMESH_LOG_LEVEL="WARNING")
    ports = {
        "gateway": int(env["AGENTMESH_GATEWAY_PORT"]),
        "mock": free_port(),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentmesh.cli", "up", "--mock-port", str(ports["mock"])],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if "development API key" in line:
            return proc, ports, line.rsplit(":", 1)[1].strip()
    proc.wait(30)
    raise RuntimeError("agentmesh up did not start")


async def measure(ports: dict[str, int], key: str, turns: int, warmup: int) -> dict[str, Any]:
    mock_url = f"http://127.0.0.1:{ports['mock']}"
    async with httpx.AsyncClient(timeout=30) as raw:
        (await raw.post(f"{mock_url}/_mock/rules", json=RULES)).raise_for_status()
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    mesh_runs: list[tuple[float, float, int]] = []
    direct_runs: list[tuple[float, float, int]] = []
    async with (
        httpx.AsyncClient(base_url=gateway, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http,
        AsyncOpenAI(base_url=f"{mock_url}/v1", api_key="bench", max_retries=0) as client,
    ):
        for i in range(warmup + turns):
            m = await through_mesh(http)
            d = await direct(client)
            assert m[2] == d[2], f"the mesh lost text: {m[2]} != {d[2]} characters"
            if i >= warmup:
                mesh_runs.append(m)
                direct_runs.append(d)
    mesh_total = [r[1] for r in mesh_runs]
    direct_total = [r[1] for r in direct_runs]
    added_ttfd = [m[0] - d[0] for m, d in zip(mesh_runs, direct_runs, strict=True)]
    ratios = [m / d for m, d in zip(mesh_total, direct_total, strict=True)]
    return {
        "scenario": "2000-token reply at top speed: SSE through the whole mesh vs openai client direct",
        "command": "make bench",
        "turns": turns,
        "machine": machine(),
        "reply_chars": mesh_runs[0][2],
        "direct_completion_s": {"p50": statistics.median(direct_total), "p99": pct(direct_total, 99)},
        "mesh_completion_s": {"p50": statistics.median(mesh_total), "p99": pct(mesh_total, 99)},
        "completion_ratio": {"p50": statistics.median(ratios), "p99": pct(ratios, 99)},
        "direct_ttfd_ms": {"p50": 1000 * statistics.median(r[0] for r in direct_runs)},
        "added_ttfd_ms": {"p50": 1000 * statistics.median(added_ttfd), "p99": 1000 * pct(added_ttfd, 99)},
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    proc, ports, key = start_mesh()
    try:
        result = asyncio.run(measure(ports, key, args.turns, args.warmup))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    c, t = result["completion_ratio"], result["added_ttfd_ms"]
    print(f"machine: {result['machine']['cpu']} ({result['machine']['cores']} cores)")
    print(
        f"direct completion p50 {result['direct_completion_s']['p50'] * 1000:.1f} ms; "
        f"through the mesh p50 {result['mesh_completion_s']['p50'] * 1000:.1f} ms"
    )
    print(f"completion ratio mesh/direct: p50 {c['p50']:.2f}x, p99 {c['p99']:.2f}x")
    print(f"added time to first delta: p50 {t['p50']:.1f} ms, p99 {t['p99']:.1f} ms")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    cli()
