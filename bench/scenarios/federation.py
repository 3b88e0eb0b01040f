"""Scenario G (federation): the time of `GET /api/traces/{id}/messages` for a 1,000-message trace read
three ways in the same run, by two meshes on loopback (each with its own SQLite database):

- local: on the mesh where the trace lives;
- remote: through the other mesh (`@peer/id`), its cached copy brought up to date by an incremental read
  (the first, cold read that fetches all 1,000 messages is reported apart);
- cache: through the other mesh while the peer is down (`stale: true`, answered from the copy).

`python -m bench.scenarios.federation [--rounds N]`, or `make bench` (scenario G of bench/run.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

MESSAGES = 1000


def _dist(values: list[float]) -> dict[str, float]:
    ms = sorted(v * 1000 for v in values)
    return {
        "p50_ms": round(statistics.median(ms), 2),
        "max_ms": round(ms[-1], 2),
        "mean_ms": round(statistics.fmean(ms), 2),
        "n": len(ms),
    }


async def run(rounds: int = 20, work: Path | None = None) -> dict[str, Any]:
    from tests.mesh import Ports, start_mesh

    tmp = Path(work or tempfile.mkdtemp(prefix="bench-g-"))
    os.makedirs(tmp, exist_ok=True)
    ports = Ports()
    home_port, reader_port = ports.take(), ports.take()
    env_name = f"BENCH_G_{uuid.uuid4().hex[:8].upper()}"
    peers = tmp / "peers.yaml"
    peers.write_text(
        yaml.safe_dump({"peers": {"home": {"url": f"http://127.0.0.1:{home_port}", "credential": env_name}}})
    )
    home = await start_mesh(tmp / "home", gateway_port=home_port)
    os.environ[env_name] = home.api_key  # set before the start: an unset credential variable stops it
    reader = await start_mesh(tmp / "reader", gateway_port=reader_port, peers=str(peers))
    try:
        async with home.http() as http:
            created = await http.post("/api/chat", json={"agent": "general", "message": "hello"})
            start = next(line for line in created.text.splitlines() if '"start"' in line)
            tid = json.loads(start[5:])["traceId"]
            for i in range(0, MESSAGES - 2, 100):
                batch = [{"role": "user", "content": f"message {i + j} " + "x" * 200} for j in range(100)]
                resp = await http.post(
                    f"/api/traces/{tid}/messages", json={"messages": batch[: MESSAGES - 2 - i]}
                )
                assert resp.status_code == 200, resp.text
        params = {"limit": MESSAGES}
        path = f"/api/traces/{tid}/messages"
        remote_path = f"/api/traces/@home/{tid}/messages"

        async def timed(client: Any, p: str) -> tuple[float, dict[str, Any]]:
            t0 = time.perf_counter()
            r = await client.get(p, params=params)
            elapsed = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            body = r.json()
            assert len(body["messages"]) == MESSAGES, len(body["messages"])
            return elapsed, body

        local, remote, cache = [], [], []
        async with home.http() as h, reader.http() as rd:
            cold, _ = await timed(rd, remote_path)  # the first read: all 1,000 messages fetched and stored
            await timed(h, path)  # warm-up
            for _ in range(rounds):
                local.append((await timed(h, path))[0])
                elapsed, body = await timed(rd, remote_path)
                assert body["stale"] is False
                remote.append(elapsed)
            assert home.gateway is not None
            await home.gateway.stop()  # the peer goes away: the cache answers
            home.gateway = None
            for _ in range(rounds):
                elapsed, body = await timed(rd, remote_path)
                assert body["stale"] is True
                cache.append(elapsed)
        return {
            "messages": MESSAGES,
            "rounds": rounds,
            "local": _dist(local),
            "remote": _dist(remote),
            "remote_cold_ms": round(cold * 1000, 2),
            "cache_peer_down": _dist(cache),
        }
    finally:
        os.environ.pop(env_name, None)
        await reader.stop()
        await home.stop()
        ports.release()


def markdown(r: dict[str, Any]) -> list[str]:
    if "failed" in r:
        return ["## G: federation reads", "", f"failed: {r['failed']}", ""]
    rows = [
        ("local (the trace's own mesh)", r["local"]),
        ("remote (through a peer, incremental sync)", r["remote"]),
        ("cache (through a peer that is down, stale)", r["cache_peer_down"]),
    ]
    lines = [
        "## G: federation reads",
        "",
        f"`GET /api/traces/{{id}}/messages?limit={r['messages']}` of a {r['messages']}-message trace, "
        f"{r['rounds']} reads each, same run (the first remote read, which fetches and stores all of it: "
        f"{r['remote_cold_ms']} ms).",
        "",
        "| read | p50 ms | mean ms | max ms |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {d['p50_ms']} | {d['mean_ms']} | {d['max_ms']} |" for name, d in rows]
    return [*lines, ""]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    result = asyncio.run(run(args.rounds))
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
