"""Scenario C: N concurrent paced sessions, their starts spread evenly over a few seconds, one phase per
target and N, driven by the load generator's worker processes (bench/loadgen.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psutil

from bench.harness import Bench, cpu_delta, cpu_report
from bench.loadgen import JobResult, LoadGenerator
from bench.stats import check_tokens, dist, error_detail, gaps_minus_pace, lateness


def load_procs_for(setting: str, n: int) -> int:
    """--load-procs: a number, or auto: one worker process per 250 sessions, at most one per core.

    Measured on the 2-core VM, direct phase (model server only) at 20 tokens/s: one process reading
    500 streams lagged (event loop lag p99 530 ms, first delta p50 400 ms) where two did not (42 ms,
    4 ms); at 1,000 streams one process gave first delta p50 2.9 s and loop lag p99 770 ms, two
    150 ms and 310 ms, four (more processes than cores) 830 ms and 420 ms."""
    if setting != "auto":
        return max(1, int(setting))
    return max(1, min(psutil.cpu_count() or 1, -(-n // 250)))


async def _c_phase(bench: Bench, gen: LoadGenerator, target: str, n: int) -> dict[str, Any]:
    z = bench.sizes
    if not await bench.wait_model_idle():
        print(f"  warning: the model server still streams before C {target} N={n}", flush=True)
    settled = await bench.wait_quiet()
    if settled is None:
        print(f"  warning: a target still burns CPU before C {target} N={n}", flush=True)
    await bench.mock_reset()
    if target == "mesh":
        # A mesh with several gateways (the scale-out run) has its sessions spread over them in turn.
        base = bench.mesh.urls or [bench.mesh.url]
        headers, agent = {"Authorization": f"Bearer {bench.mesh.extra['key']}"}, "plain"
    elif target == "direct":
        base, headers, agent = [bench.mock.url], {}, ""
    else:
        base, headers, agent = [bench.peers[target].url], {}, ""
    tags = [f"bench-c n{n} {target} {i}" for i in range(n)]
    stream_s = z.c_tokens / z.c_tps
    t0 = time.time() + 1.0
    starts = [t0 + z.c_spread_s * i / n for i in range(n)]
    deadline = t0 + z.c_spread_s + 4 * stream_s + 30
    rpcs_before = await bench.rpcs() if target == "mesh" else {}
    before = bench.cpu()
    results: list[JobResult] = await asyncio.to_thread(
        gen.run, target, base, headers, agent, tags, starts, deadline
    )
    after = bench.cpu()
    rpcs_after = await bench.rpcs() if target == "mesh" else {}
    stats = await bench.mock_get("/_mock/stats")
    received = await bench.received_at()
    streams = [s for r in results for s in r.streams]
    errors = check_tokens(streams, z.c_tokens)
    first, to_model, over, late, last_late = [], [], [], [], []
    for s in streams:
        if s.first:
            first.append(s.first - s.start)
        if received.get(s.tag):
            to_model.append(received[s.tag][0] - s.start)
        _, o = gaps_minus_pace(s, z.c_tps)
        over += o
        if received.get(s.tag) and s.times:
            lt = lateness(s, received[s.tag][0], z.c_tps)
            late += lt
            if s.error is None:
                last_late.append(lt[-1])
    tokens = sum(s.token_count for s in streams)
    gen_wall = max(r.wall_s for r in results)
    lag = [x for r in results for x in r.lag_ms]
    return {
        "target": target,
        "n": n,
        "settle_s": settled,  # waited for the machine to go quiet before the phase (None: it did not)
        "ok": sum(1 for s in streams if s.error is None),
        "errors": dict(errors),
        "error_detail": error_detail(streams),
        "first_delta_ms": dist(first, 1000),
        "to_model_ms": dist(to_model, 1000),
        "gap_minus_pace_ms": dist(over, 1000),
        "lateness_ms": dist(late, 1000),
        "last_token_lateness_ms": dist(last_late, 1000),
        "tokens": tokens,
        "model_requests": stats["total"],
        "model_max_in_flight": stats["max_in_flight"],
        "cpu": cpu_report(before, after, {target: tokens}),
        "per_turn": per_turn(before, after, target, n, rpcs_before, rpcs_after),
        "load_generator": {
            "processes": len(results),
            "cpu_s": sum(r.cpu_s for r in results),
            "busiest_process_utilisation": max(r.cpu_s / r.wall_s for r in results if r.wall_s),
            "loop_lag_ms": dist(lag),
            "wall_s": gen_wall,
        },
    }


def per_turn(
    before: dict[str, Any],
    after: dict[str, Any],
    target: str,
    turns: int,
    rpcs_before: dict[str, float],
    rpcs_after: dict[str, float],
) -> dict[str, Any]:
    """A turn's share of the phase: CPU milliseconds by process (tokens included) and, for the mesh,
    the RPCs its services started (by method, and in all)."""
    cpu = {k: 1000 * v / turns for k, v in sorted(cpu_delta(before, after, target).items())} if turns else {}
    rpcs = {k: (v - rpcs_before.get(k, 0.0)) / turns for k, v in rpcs_after.items()} if turns else {}
    rpcs = {k: round(v, 2) for k, v in sorted(rpcs.items()) if v > 0}
    return {
        "cpu_ms": cpu,
        "cpu_ms_total": sum(cpu.values()),
        "rpcs": rpcs,
        "rpcs_total": round(sum(rpcs.values()), 2) if rpcs else None,
    }


async def scenario_c(bench: Bench) -> dict[str, Any]:
    """C: N concurrent paced sessions, starts spread evenly over a few seconds, per target and N."""
    z = bench.sizes
    result: dict[str, Any] = {
        "what": (
            f"N concurrent sessions, {z.c_tokens} tokens each at {z.c_tps:g} tokens/s, "
            f"starts spread evenly over {z.c_spread_s:g} s"
        ),
        "phases": [],
    }
    procs = max(load_procs_for(bench.load_procs, n) for n in z.c_sessions)
    gen = await asyncio.to_thread(LoadGenerator, procs)
    try:
        for j, n in enumerate(z.c_sessions):
            order = bench.targets[j % len(bench.targets) :] + bench.targets[: j % len(bench.targets)]
            for target in order:
                gen.procs = load_procs_for(bench.load_procs, n)
                print(f"  C N={n} {target} ...", flush=True)
                phase = await _c_phase(bench, gen, target, n)
                result["phases"].append(phase)
                print("   ", _c_line(phase), flush=True)
    finally:
        gen.close()
    await bench.wait_model_idle()
    return result


def _c_line(p: dict[str, Any]) -> str:
    per = p["cpu"][p["target"]]["per_1k_tokens_s"] if p["target"] in p["cpu"] else None
    return (
        f"ok {p['ok']}/{p['n']} errors {p['errors'] or '-'}"
        f" first p50 {p['first_delta_ms'].get('p50', 0):.0f} ms"
        f" gap-pace p99 {p['gap_minus_pace_ms'].get('p99', 0):.1f} ms"
        f" lateness p99 {p['lateness_ms'].get('p99', 0):.0f} ms"
        + (f" cpu {per:.3f} s/1k tok" if per is not None else "")
        + f" loadgen {p['load_generator']['busiest_process_utilisation']:.0%}"
    )
