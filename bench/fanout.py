"""Many readers of one live buffer through one gateway: the CPU the stream service and the gateway spend
per 1,000 events of the buffer while M browsers read it (docs/design/streams.md#shared-follows).

Starts the scripted model server and `agentmesh up --no-mock-llm` (bench/procs.py), begins one chat
turn of T tokens at R tokens/s (POST /api/chat), and once its first event came, opens M readers of
its session's stream (GET /api/sessions/{id}/stream, SSE, from the start), each reading to the end.
CPU is counted from when every reader has its first event to when every reader ended; the stream
service's `agentmesh_stream_subscribers` is read meanwhile (the subscriptions serving the readers).
With `--compare DIR` another checkout (its generated code built, and `agentmesh/{libs,gateway,services}`
linked to its own folders so that its processes import its code) runs the same turn first.

    .venv/bin/python -m bench.fanout --readers 50 --tokens 1500 --tps 50 --compare ../base
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench import procs

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / ".agentmesh" / "bench-fanout"
_SUBSCRIBERS = re.compile(r"^agentmesh_stream_subscribers (\S+)$", re.M)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.fanout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--readers", type=int, default=50, help="readers of the one buffer (M)")
    p.add_argument("--tokens", type=int, default=1500, help="tokens of the turn")
    p.add_argument("--tps", type=float, default=50.0, help="the model's pace, tokens per second")
    p.add_argument("--compare", type=Path, help="another checkout to run first under the same load")
    p.add_argument("--rounds", type=int, default=1, help="with --compare: base, this, base, this, ...")
    p.add_argument("--out", type=Path, default=WORK / "fanout.json")
    return p.parse_args(argv)


def write_rules(path: Path, tokens: int, tps: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rules = {
        "ttft_ms": 0,
        "tokens_per_second": 0,
        "models": ["mock-gpt"],
        "rules": [{"name": "fan", "user": "^bench-fan ", "tokens": tokens, "tokens_per_second": tps}],
        "default": {"text": "unscripted bench request: {user}"},
    }
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


async def _read(client: httpx.AsyncClient, method: str, path: str, counts: list[int], index: int,
                first: asyncio.Event, seen: dict[str, str], **kw: Any) -> None:  # fmt: skip
    """Reads one SSE response to its end, counting its events (`seen`: the session id one named)."""
    async with client.stream(method, path, **kw) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            counts[index] += 1
            if "session" not in seen and ('"traceId"' in line or '"sessionId"' in line):
                data = json.loads(line[5:])
                seen["session"] = data.get("traceId") or data["sessionId"]
            first.set()


async def _subscribers(client: httpx.AsyncClient, url: str) -> float:
    found = _SUBSCRIBERS.search((await client.get(url)).text)
    return float(found.group(1)) if found else -1.0


async def drive(mesh: procs.Proc, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    """One turn and its M readers; the CPU between every reader's first event and the last one's end."""
    headers = {"Authorization": f"Bearer {mesh.extra['key']}"}
    limits = httpx.Limits(max_connections=args.readers + 8, max_keepalive_connections=args.readers + 8)
    async with httpx.AsyncClient(base_url=mesh.url, headers=headers, timeout=600, limits=limits) as client:
        await client.post("/api/chat", json={"agent": "plain", "message": "warm-up"})  # imports, connections
        counts = [0] * (args.readers + 1)
        begun = asyncio.Event()
        body = {"agent": "plain", "message": f"bench-fan {tag}"}
        seen: dict[str, str] = {}
        turn_task = asyncio.create_task(_read(client, "POST", "/api/chat", counts, 0, begun, seen, json=body))
        await asyncio.wait_for(begun.wait(), 60)
        session = seen["session"]
        firsts = [asyncio.Event() for _ in range(args.readers)]
        path = f"/api/sessions/{session}/stream"
        readers = [
            asyncio.create_task(_read(client, "GET", path, counts, i + 1, firsts[i], {}))
            for i in range(args.readers)
        ]
        await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 60)
        counted = list(counts)
        before = mesh.cpu()
        t0 = time.monotonic()
        subscribers = await _subscribers(client, mesh.metrics["stream"])
        await asyncio.gather(turn_task, *readers)
        wall = time.monotonic() - t0
        after = mesh.cpu()
    events = sum(counts[1:]) - sum(counted[1:])  # delivered to the readers while counted
    per_reader = events / args.readers
    cpu = {label: after[label] - before.get(label, 0.0) for label in after}
    per_1k = {label: round(1000 * v / per_reader, 4) for label, v in sorted(cpu.items()) if per_reader}
    return {
        "readers": args.readers,
        "events_per_reader": round(per_reader, 1),
        "wall_s": round(wall, 2),
        "stream_subscribers": subscribers,
        "cpu_s": {k: round(v, 3) for k, v in sorted(cpu.items())},
        "cpu_per_1k_events_s": per_1k,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    procs.raise_fd_limit()
    WORK.mkdir(parents=True, exist_ok=True)
    meshes: list[tuple[str, Path | None]] = [("this", None)]
    if args.compare is not None:
        meshes = [("base", args.compare.resolve()), ("this", None)] * args.rounds
    mock = procs.start_mock(WORK, write_rules(WORK / "rules.yaml", args.tokens, args.tps))
    reports: list[dict[str, Any]] = []
    try:
        for n, (name, root) in enumerate(meshes):
            mesh = procs.start_mesh(WORK / name, mock.url, HERE / "catalog.yaml", root=root)
            try:
                time.sleep(2.0)
                report = asyncio.run(drive(mesh, args, f"{name} {n}"))
            finally:
                mesh.stop()
            reports.append({"mesh": name, "root": str(root or HERE.parent), **report})
            per = report["cpu_per_1k_events_s"]
            print(f"### {name} ({root or HERE.parent}): {args.readers} readers x "
                  f"{report['events_per_reader']} events in {report['wall_s']} s, stream subscribers "
                  f"{report['stream_subscribers']:g}; CPU s per 1,000 events: "
                  + "  ".join(f"{k} {v:.3f}" for k, v in per.items()), flush=True)  # fmt: skip
    finally:
        mock.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(reports, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
