"""Scenarios A and B: one session at a time, the targets interleaved turn by turn, each turn after the
one before it settled. A: a long reply at the model server's top speed; B: a paced reply."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from openai import AsyncOpenAI

from bench import clients
from bench.clients import Stream
from bench.harness import Bench, cpu_report
from bench.procs import running_threads
from bench.stats import check_tokens, dist, gaps_minus_pace, lateness, paired

SETTLE_S = 2.0  # the longest a turn waits for the one before it to be over
SETTLE_READINGS = 3  # readings in a row, SETTLE_POLL_S apart, with no thread of it running
SETTLE_POLL_S = 0.001


async def settle(pids: list[int]) -> float:
    """Waits until the processes of the turn just measured are done with it (none of their threads
    running in SETTLE_READINGS readings in a row, at most SETTLE_S): work a target does after its
    stream closed (a peer's checkpoints, a model server's log) is not billed to the next target's turn.
    Returns the seconds waited."""
    started = time.monotonic()
    quiet = 0
    while quiet < SETTLE_READINGS and time.monotonic() - started < SETTLE_S:
        quiet = quiet + 1 if running_threads(pids) == 0 else 0
        await asyncio.sleep(SETTLE_POLL_S)
    return time.monotonic() - started


async def _turns(bench: Bench, prefix: str, turns: int, warmup: int) -> tuple[dict[str, list[Stream]], dict]:
    """Runs warmup + turns rounds, each one stream per target (rotating order), each turn after the one
    before it settled; returns the measured streams per target and the CPU readings around the measured
    rounds (with `settle_s`: per target, how long the turn after each of its turns waited). Beside
    `direct` (the openai client, what the runtime itself uses), `raw` reads the model server with plain
    httpx: the floor of what any client can do with the same stream."""
    targets = bench.targets
    if "direct" in targets:
        targets = ["direct", "raw", *targets[1:]]
    https = {t: bench.http_for(t) for t in targets if t not in ("direct", "raw")}
    out: dict[str, list[Stream]] = {t: [] for t in targets}
    cpu: dict[str, Any] = {"settle_s": {t: [] for t in targets}}
    pids = bench.turn_pids()
    pids["raw"] = pids["direct"]
    async with (
        AsyncOpenAI(base_url=f"{bench.mock.url}/v1", api_key="bench", max_retries=0) as direct,
        bench.http_for("direct") as raw,
    ):
        try:
            for i in range(warmup + turns):
                if i == warmup:
                    cpu["before"] = bench.cpu()
                order = targets[i % len(targets) :] + targets[: i % len(targets)]
                for target in order:
                    s = Stream(target=target, tag=f"{prefix} {i} {target}")
                    if target == "direct":
                        await clients.direct_openai(direct, s)
                    elif target == "raw":
                        await clients.direct_raw(raw, s)
                    elif target == "mesh":
                        await clients.mesh(https[target], s, "plain")
                    else:
                        await clients.langgraph(https[target], s)
                    if i >= warmup:
                        out[target].append(s)
                    cpu["settle_s"][target].append(await settle(pids[target]))
            cpu["after"] = bench.cpu()
        finally:
            for http in https.values():
                await http.aclose()
    return out, cpu


def _added_first_delta(runs: dict[str, list[Stream]], target: str, base: str) -> dict[str, float]:
    """What `target` adds to the first delta over `base`, turn by turn (paired within each round)."""
    return dist([(t.first - t.start) - (d.first - d.start) for t, d in paired(runs, target, base)], 1000)


async def scenario_a(bench: Bench) -> dict[str, Any]:
    """A: a long reply at the model server's top speed; completion ratio and added first delta."""
    z = bench.sizes
    runs, cpu = await _turns(bench, "bench-a", z.a_turns, z.a_warmup)
    result: dict[str, Any] = {
        "what": f"{z.a_tokens}-token reply at the model server's top speed, one session at a time",
        "turns": z.a_turns,
        "warmup": z.a_warmup,
        "targets": {},
        "samples": {},
    }
    for target, streams in runs.items():
        errors = check_tokens(streams, z.a_tokens)
        ok = [s for s in streams if s.error is None]
        entry: dict[str, Any] = {
            "errors": dict(errors),
            "completion_ms": dist([s.end - s.start for s in ok], 1000),
            "first_delta_ms": dist([s.first - s.start for s in ok], 1000),
            "events_per_reply": statistics.median(len(s.times) for s in ok) if ok else None,
        }
        if target not in ("direct", "raw") and "direct" in runs:
            pairs = paired(runs, target)
            entry["completion_ratio"] = dist([(t.end - t.start) / (d.end - d.start) for t, d in pairs])
            # after the first delta: the relay of the tokens alone, without set-up (or a queue's wait)
            entry["streaming_ratio"] = dist([(t.end - t.first) / (d.end - d.first) for t, d in pairs])
            entry["added_first_delta_ms"] = _added_first_delta(runs, target, "direct")
            floor = paired(runs, target, "raw")
            entry["completion_ratio_vs_raw"] = dist([(t.end - t.start) / (d.end - d.start) for t, d in floor])
            entry["added_first_delta_vs_raw_ms"] = _added_first_delta(runs, target, "raw")
        result["targets"][target] = entry
        result["samples"][target] = {
            "completion_ms": [round(1000 * (s.end - s.start), 3) for s in ok],
            "first_delta_ms": [round(1000 * (s.first - s.start), 3) for s in ok],
        }
    tokens = {t: sum(s.token_count for s in streams) for t, streams in runs.items()}
    result["cpu"] = cpu_report(cpu["before"], cpu["after"], tokens)
    result["cpu"]["note"] = (
        "over the measured turns of every target: a target's processes idle (a little) while the others run"
    )
    result["settle_ms"] = {t: dist(waits, 1000) for t, waits in cpu["settle_s"].items()}
    return result


async def scenario_b(bench: Bench) -> dict[str, Any]:
    """B: a paced reply; added first delta, inter-delta gaps and lateness against the schedule."""
    z = bench.sizes
    runs, cpu = await _turns(bench, "bench-b", z.b_turns, z.b_warmup)
    received = await bench.received_at()
    result: dict[str, Any] = {
        "what": f"{z.b_tokens}-token reply at {z.b_tps:g} tokens/s, one session at a time",
        "turns": z.b_turns,
        "warmup": z.b_warmup,
        "targets": {},
        "samples": {},
    }
    for target, streams in runs.items():
        errors = check_tokens(streams, z.b_tokens)
        ok = [s for s in streams if s.error is None]
        gaps: list[float] = []
        over: list[float] = []
        late: list[float] = []
        for s in ok:
            g, o = gaps_minus_pace(s, z.b_tps)
            gaps += g
            over += o
            if received.get(s.tag):
                late += lateness(s, received[s.tag][0], z.b_tps)
        entry: dict[str, Any] = {
            "errors": dict(errors),
            "first_delta_ms": dist([s.first - s.start for s in ok], 1000),
            "to_model_ms": dist([received[s.tag][0] - s.start for s in ok if received.get(s.tag)], 1000),
            "gap_ms": dist(gaps, 1000),
            "gap_minus_pace_ms": dist(over, 1000),
            "lateness_ms": dist(late, 1000),
        }
        if target not in ("direct", "raw") and "direct" in runs:
            entry["added_first_delta_ms"] = _added_first_delta(runs, target, "direct")
            entry["added_first_delta_vs_raw_ms"] = _added_first_delta(runs, target, "raw")
        result["targets"][target] = entry
        result["samples"][target] = {
            "first_delta_ms": [round(1000 * (s.first - s.start), 3) for s in ok],
            "gap_ms": [round(1000 * g, 3) for g in gaps],
        }
    result["settle_ms"] = {t: dist(waits, 1000) for t, waits in cpu["settle_s"].items()}
    return result
