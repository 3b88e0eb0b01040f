"""Scenarios D and F: turns of several agents. D: a supervisor's delegate_parallel of subagents; F: an
agent-invoke call, local or over A2A."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench import clients
from bench.clients import Stream
from bench.harness import Bench
from bench.stats import dist, user_text


async def scenario_d(bench: Bench) -> dict[str, Any]:
    """D: a supervisor runs `d_children` subagents with delegate_parallel, each streaming d_tokens at
    d_tps; the turn's wall time over the slowest child's own model time."""
    z = bench.sizes
    child_model_s = (z.d_tokens - 1) / z.d_tps if z.d_tps > 0 else 0.0
    streams: list[Stream] = []
    async with bench.http_for("mesh") as http:
        for i in range(z.d_warmup + z.d_turns):
            s = Stream(target="mesh", tag=f"bench-d {i}")
            await clients.mesh(http, s, "bench-sup")
            if i >= z.d_warmup:
                streams.append(s)
    log = await bench.mock_log()
    turns = []
    errors: Counter[str] = Counter()
    for s in streams:
        sup = sorted(float(e["received_at"]) for e in log if user_text(e["body"]) == s.tag)
        kids = sorted(
            float(e["received_at"])
            for e in log
            if user_text(e["body"]).startswith("bench-d-child ")
            and user_text(e["body"]).split(": ", 1)[-1] == s.tag
        )
        if s.error is not None:
            errors[s.error] += 1
            continue
        if len(kids) != z.d_children or len(sup) < 2:
            errors[f"children:{len(kids)}/{z.d_children},supervisor_calls:{len(sup)}"] += 1
            continue
        wall = s.end - s.start
        turns.append(
            {
                "wall_s": wall,
                "ratio": wall / child_model_s if child_model_s else None,
                "to_first_child_s": kids[0] - s.start,
                "child_start_spread_s": kids[-1] - kids[0],
                "fan_in_s": sup[1] - (kids[-1] + child_model_s),
                "tail_s": s.end - sup[1],
            }
        )

    def p50(key: str) -> float | None:
        values = [v for t in turns if (v := t[key]) is not None]
        return statistics.median(values) if values else None

    return {
        "what": (
            f"delegate_parallel with {z.d_children} subagents, "
            f"{z.d_tokens} tokens each at {z.d_tps:g} tokens/s"
        ),
        "turns": z.d_turns,
        "warmup": z.d_warmup,
        "slowest_child_model_s": child_model_s,
        "errors": dict(errors),
        "p50": {
            k: p50(k)
            for k in ("wall_s", "ratio", "to_first_child_s", "child_start_spread_s", "fan_in_s", "tail_s")
        },
        "max_ratio": max((t["ratio"] for t in turns if t["ratio"] is not None), default=None),
        "per_turn": turns,
    }


async def scenario_f(bench: Bench) -> dict[str, Any]:
    """F: the added latency of agent-invoke over A2A. The same caller invokes the same callee (one
    model call of f_tokens) either locally (agentSlug bench-callee: a child turn through the
    orchestrator) or as a remote A2A agent (bench-callee-a2a: the catalog's remote entry for this very
    mesh's /a2a/bench-callee, so the a2a-sdk client, the gateway's A2A server and its executor are all
    on the path). Turns interleave local and remote; the figure is the difference of the turn times."""
    z = bench.sizes
    walls: dict[str, list[float]] = {"local": [], "remote": []}
    errors: Counter[str] = Counter()
    async with bench.http_for("mesh") as http:
        for i in range(z.f_warmup + z.f_turns):
            for kind in ("local", "remote") if i % 2 == 0 else ("remote", "local"):
                s = Stream(target="mesh", tag=f"bench-f-{kind} {i}")
                await clients.mesh(http, s, "bench-caller")
                if s.error is not None:
                    errors[f"{kind}:{s.error}"] += 1
                elif i >= z.f_warmup:
                    walls[kind].append(s.end - s.start)
    local, remote = dist(walls["local"], 1000), dist(walls["remote"], 1000)
    added = {q: remote[q] - local[q] for q in ("p50", "p99") if q in local and q in remote}
    return {
        "what": f"agent-invoke of a {z.f_tokens}-token callee, local vs over A2A (same mesh, same model)",
        "turns": z.f_turns,
        "warmup": z.f_warmup,
        "local_ms": local,
        "remote_ms": remote,
        "added_ms": added,
        "errors": dict(errors),
    }
