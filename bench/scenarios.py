"""Scenarios A to D (E, trace appends, is bench/scenario_e.py) and the figures they report.

Targets: `direct` (the model server read straight, the baseline of every ratio), `mesh` (POST
/api/chat through `agentmesh up`) and, with --peers langgraph, `langgraph` (`langgraph dev`). All
read the same model server process in the same run; single-session scenarios interleave the
targets turn by turn (the order rotating every turn), scenario C runs one phase per target and N.

Times: "first delta" is request sent -> first text delta; a "gap" is the time between two
text-carrying events of one stream, and "gap - pace" subtracts the time the model server put
between them (tokens in the event / tokens per second); "lateness" is a token's arrival minus the
time the model server's schedule emitted it (request received, per its request log, + ttft +
(k - 1) / tokens per second for token k), so it is what everything after the model added.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from openai import AsyncOpenAI

from bench import clients
from bench.clients import Stream
from bench.loadgen import JobResult, LoadGenerator
from bench.procs import Proc, own_cpu_s, running_threads, system_busy_s


@dataclass
class Sizes:
    """What each scenario does; the defaults are the full run, --quick shrinks them."""

    a_tokens: int = 2000
    a_turns: int = 30
    a_warmup: int = 3
    b_tokens: int = 200
    b_tps: float = 50
    b_turns: int = 20
    b_warmup: int = 2
    c_sessions: list[int] = field(default_factory=lambda: [50, 200, 500, 1000])
    c_tokens: int = 120
    c_tps: float = 20
    c_spread_s: float = 3.0
    d_children: int = 8
    d_tokens: int = 100
    d_tps: float = 50
    d_turns: int = 5
    d_warmup: int = 1
    e_appends: int = 3000
    e_writers: int = 50
    f_tokens: int = 50
    f_turns: int = 20
    f_warmup: int = 2


QUICK = {
    "a_turns": 5,
    "a_warmup": 1,
    "b_turns": 3,
    "b_warmup": 1,
    "c_sessions": [50, 200],
    "c_tokens": 60,
    "c_spread_s": 2.0,
    "d_turns": 2,
    "d_warmup": 1,
    "e_appends": 600,
    "f_turns": 5,
    "f_warmup": 1,
}


def rules(sizes: Sizes) -> dict[str, Any]:
    """The model server's script for every scenario, keyed on the user message's first word."""
    tasks = [
        {"goal": f"bench-d-child {i}: {{user}}", "agentSlug": "bench-worker"} for i in range(sizes.d_children)
    ]
    return {
        "ttft_ms": 0,
        "tokens_per_second": 0,
        "models": ["mock-gpt"],
        "rules": [
            {"name": "d-child", "user": "^bench-d-child ", "tokens": sizes.d_tokens,
             "tokens_per_second": sizes.d_tps},
            {"name": "d-fanout", "user": "^bench-d ", "after_tool": False,
             "tool_calls": [{"name": "delegate_parallel", "arguments": {"tasks": tasks}}]},
            {"name": "d-sum", "user": "^bench-d ", "after_tool": True, "tokens": 10},
            {"name": "f-local", "user": "^bench-f-local ", "after_tool": False,
             "tool_calls": [{"name": "agent-invoke",
                             "arguments": {"agentSlug": "bench-callee", "input": "bench-f-callee {user}"}}]},
            {"name": "f-remote", "user": "^bench-f-remote ", "after_tool": False,
             "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "bench-callee-a2a",
                                                                   "input": "bench-f-callee {user}"}}]},
            {"name": "f-sum", "user": "^bench-f-(local|remote) ", "after_tool": True, "tokens": 5},
            {"name": "f-callee", "user": "^bench-f-callee ", "tokens": sizes.f_tokens},
            {"name": "a", "user": "^bench-a ", "tokens": sizes.a_tokens},
            {"name": "b", "user": "^bench-b ", "tokens": sizes.b_tokens, "tokens_per_second": sizes.b_tps},
            {"name": "c", "user": "^bench-c ", "tokens": sizes.c_tokens, "tokens_per_second": sizes.c_tps},
        ],
        "default": {"text": "unscripted bench request: {user}"},
    }  # fmt: skip


def write_rules(path: Path, sizes: Sizes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(rules(sizes), sort_keys=False))
    return path


# --- statistics --------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    """The q-th percentile, nearest rank (NaN for no values)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def dist(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """p50, p99, max and count of `values` times `scale` (1000: seconds to milliseconds)."""
    if not values:
        return {"n": 0}
    return {
        "p50": scale * statistics.median(values),
        "p99": scale * pct(values, 99),
        "max": scale * max(values),
        "n": len(values),
    }


def gaps_minus_pace(s: Stream, tps: float) -> tuple[list[float], list[float]]:
    """(gaps, gap - pace) in seconds between consecutive text events of one stream."""
    gaps, late = [], []
    for i in range(1, len(s.times)):
        gap = s.times[i] - s.times[i - 1]
        gaps.append(gap)
        late.append(gap - (s.tokens[i] / tps if tps > 0 else 0.0))
    return gaps, late


def lateness(s: Stream, received_at: float, tps: float, ttft_s: float = 0.0) -> list[float]:
    """Each token's arrival minus the model server's schedule for it (seconds)."""
    out: list[float] = []
    k = 0
    interval = 1 / tps if tps > 0 else 0.0
    for t, n in zip(s.times, s.tokens, strict=True):
        for _ in range(n):
            out.append(t - (received_at + ttft_s + k * interval))
            k += 1
    return out


def user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


# --- the running bench --------------------------------------------------------------------------------


@dataclass
class Bench:
    sizes: Sizes
    mock: Proc
    mesh: Proc
    peers: dict[str, Proc]
    load_procs: str = "auto"
    only: list[str] = field(default_factory=list)  # --targets: a subset, for diagnosis

    @property
    def targets(self) -> list[str]:
        every = ["direct", "mesh", *self.peers]
        return [t for t in every if t in self.only] if self.only else every

    def procs(self) -> dict[str, Proc]:
        return {"mesh": self.mesh, **self.peers}

    def turn_pids(self) -> dict[str, list[int]]:
        """Per target, the processes a turn of it keeps busy: its own and the model server's."""
        model = [p.pid for p in self.mock.processes()]
        out = {"direct": model}
        for name, proc in self.procs().items():
            out[name] = model + [p.pid for p in proc.processes()]
        return out

    async def mock_get(self, path: str) -> Any:
        async with httpx.AsyncClient(base_url=self.mock.url, timeout=60) as http:
            resp = await http.get(path)
            resp.raise_for_status()
            return resp.json()

    async def mock_reset(self) -> None:
        async with httpx.AsyncClient(base_url=self.mock.url, timeout=60) as http:
            (await http.post("/_mock/reset")).raise_for_status()

    async def mock_log(self) -> list[dict[str, Any]]:
        """The model server's request log: index, received_at (epoch seconds), rule, body."""
        return list((await self.mock_get("/_mock/requests"))["requests"])

    async def received_at(self) -> dict[str, list[float]]:
        """User message -> the times the model server received requests carrying it."""
        out: dict[str, list[float]] = {}
        for entry in await self.mock_log():
            out.setdefault(user_text(entry["body"]), []).append(float(entry["received_at"]))
        return out

    async def wait_model_idle(self, timeout_s: float = 120.0) -> bool:
        """Waits until the model server streams nothing (a cut client's turn may still be running)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self.mock_get("/_mock/stats"))["in_flight"] == 0:
                return True
            await asyncio.sleep(0.25)
        return False

    async def wait_quiet(self, timeout_s: float = 120.0, cores: float = 0.1) -> float | None:
        """Waits until no target and not the model server burns more than `cores` (two readings
        0.5 s apart in a row): work left over from a phase (a cut client's run still going) must not
        run into the next one. Returns the seconds waited, None when the timeout passed first."""
        started = time.monotonic()
        quiet = 0
        last = self.cpu()
        while time.monotonic() - started < timeout_s:
            await asyncio.sleep(0.5)
            now = self.cpu()
            wall = now["wall"] - last["wall"]
            rates = [sum(cpu_delta(last, now, t).values()) / wall for t in now["targets"]]
            rates.append((now["mock"] - last["mock"]) / wall)
            quiet = quiet + 1 if max(rates) < cores else 0
            if quiet >= 2:
                return time.monotonic() - started
            last = now
        return None

    def cpu(self) -> dict[str, Any]:
        """CPU seconds so far: per target (by process label), the model server, this process, the machine."""
        return {
            "targets": {name: proc.cpu() for name, proc in self.procs().items()},
            "mock": sum(self.mock.cpu().values()),
            "harness": own_cpu_s(),
            "machine": system_busy_s(),
            "wall": time.time(),
        }

    def http_for(self, target: str, connections: int = 16, read_s: float = 300.0) -> httpx.AsyncClient:
        kw: dict[str, Any] = {"limits": clients.limits(connections), "timeout": clients.timeout(read_s)}
        if target == "mesh":
            headers = {"Authorization": f"Bearer {self.mesh.extra['key']}"}
            return httpx.AsyncClient(base_url=self.mesh.url, headers=headers, **kw)
        if target == "direct":
            return httpx.AsyncClient(base_url=self.mock.url, **kw)
        return httpx.AsyncClient(base_url=self.peers[target].url, **kw)


async def idle_cpu(bench: Bench, seconds: float) -> dict[str, Any]:
    """Cores each target (and the model server) burns while nobody sends it anything."""
    before = bench.cpu()
    await asyncio.sleep(seconds)
    after = bench.cpu()
    wall = after["wall"] - before["wall"]
    out: dict[str, Any] = {"seconds": round(wall, 2)}
    for target in after["targets"]:
        out[target] = {k: v / wall for k, v in cpu_delta(before, after, target).items()}
        out[target]["total"] = sum(out[target].values())
    out["mock"] = (after["mock"] - before["mock"]) / wall
    return out


def cpu_delta(before: dict[str, Any], after: dict[str, Any], target: str) -> dict[str, float]:
    """CPU seconds a target's processes spent between two `Bench.cpu()` readings, by process."""
    b, a = before["targets"].get(target, {}), after["targets"].get(target, {})
    return {name: a[name] - b.get(name, 0.0) for name in a}


def cpu_report(before: dict[str, Any], after: dict[str, Any], tokens: dict[str, int]) -> dict[str, Any]:
    """CPU seconds per 1,000 tokens delivered, per target and (mesh) per service; the model server
    and the harness per 1,000 tokens of all targets; how busy the whole machine was."""
    wall = after["wall"] - before["wall"]
    out: dict[str, Any] = {"wall_s": wall}
    total_tokens = sum(tokens.values())
    for target in after["targets"]:
        delta = cpu_delta(before, after, target)
        n = tokens.get(target, 0)
        out[target] = {
            "cpu_s": sum(delta.values()),
            "per_1k_tokens_s": 1000 * sum(delta.values()) / n if n else None,
            "by_process_per_1k_tokens_s": {k: 1000 * v / n for k, v in sorted(delta.items())} if n else {},
        }
    mock = after["mock"] - before["mock"]
    out["mock"] = {"cpu_s": mock, "per_1k_tokens_s": 1000 * mock / total_tokens if total_tokens else None}
    out["harness_cpu_s"] = after["harness"] - before["harness"]
    busy = after["machine"] - before["machine"]
    out["machine_busy_cores"] = busy / wall if wall > 0 else None
    return out


# --- A and B: one session at a time, targets interleaved turn by turn ----------------------------------

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
    rounds (with `settle_s`: per target, how long the turn after each of its turns waited)."""
    targets = bench.targets
    https = {t: bench.http_for(t) for t in targets if t != "direct"}
    out: dict[str, list[Stream]] = {t: [] for t in targets}
    cpu: dict[str, Any] = {"settle_s": {t: [] for t in targets}}
    pids = bench.turn_pids()
    async with AsyncOpenAI(base_url=f"{bench.mock.url}/v1", api_key="bench", max_retries=0) as direct:
        try:
            for i in range(warmup + turns):
                if i == warmup:
                    cpu["before"] = bench.cpu()
                order = targets[i % len(targets) :] + targets[: i % len(targets)]
                for target in order:
                    s = Stream(target=target, tag=f"{prefix} {i} {target}")
                    if target == "direct":
                        await clients.direct_openai(direct, s)
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


def _check(streams: list[Stream], tokens: int) -> Counter[str]:
    errors: Counter[str] = Counter()
    for s in streams:
        if s.error is None and s.token_count != tokens:
            s.error = f"short:{s.token_count}/{tokens}"
        if s.error is not None:
            errors[s.error] += 1
    return errors


def error_detail(streams: list[Stream]) -> dict[str, dict[str, Any]]:
    """Per error code: how many, after how long (request -> error, p50/max seconds), how many of
    them had received text first, and the median tokens they received."""
    by: dict[str, list[Stream]] = {}
    for s in streams:
        if s.error is not None:
            by.setdefault(s.error, []).append(s)
    out: dict[str, dict[str, Any]] = {}
    for code, failed in by.items():
        ended = [s.end - s.start for s in failed if s.end]
        out[code] = {
            "count": len(failed),
            "after_s": dist(ended),
            "with_text": sum(1 for s in failed if s.first),
            "tokens_p50": statistics.median(s.token_count for s in failed),
        }
    return out


def _paired(runs: dict[str, list[Stream]], target: str) -> list[tuple[Stream, Stream]]:
    return [
        (t, d)
        for t, d in zip(runs[target], runs["direct"], strict=True)
        if t.error is None and d.error is None
    ]


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
        errors = _check(streams, z.a_tokens)
        ok = [s for s in streams if s.error is None]
        entry: dict[str, Any] = {
            "errors": dict(errors),
            "completion_ms": dist([s.end - s.start for s in ok], 1000),
            "first_delta_ms": dist([s.first - s.start for s in ok], 1000),
            "events_per_reply": statistics.median(len(s.times) for s in ok) if ok else None,
        }
        if target != "direct" and "direct" in runs:
            pairs = _paired(runs, target)
            entry["completion_ratio"] = dist([(t.end - t.start) / (d.end - d.start) for t, d in pairs])
            # after the first delta: the relay of the tokens alone, without set-up (or a queue's wait)
            entry["streaming_ratio"] = dist([(t.end - t.first) / (d.end - d.first) for t, d in pairs])
            entry["added_first_delta_ms"] = dist(
                [(t.first - t.start) - (d.first - d.start) for t, d in pairs], 1000
            )
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
        errors = _check(streams, z.b_tokens)
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
        if target != "direct" and "direct" in runs:
            pairs = _paired(runs, target)
            entry["added_first_delta_ms"] = dist(
                [(t.first - t.start) - (d.first - d.start) for t, d in pairs], 1000
            )
        result["targets"][target] = entry
        result["samples"][target] = {
            "first_delta_ms": [round(1000 * (s.first - s.start), 3) for s in ok],
            "gap_ms": [round(1000 * g, 3) for g in gaps],
        }
    result["settle_ms"] = {t: dist(waits, 1000) for t, waits in cpu["settle_s"].items()}
    return result


# --- C: N concurrent sessions ------------------------------------------------------------------------


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
        base, headers, agent = bench.mesh.url, {"Authorization": f"Bearer {bench.mesh.extra['key']}"}, "plain"
    elif target == "direct":
        base, headers, agent = bench.mock.url, {}, ""
    else:
        base, headers, agent = bench.peers[target].url, {}, ""
    tags = [f"bench-c n{n} {target} {i}" for i in range(n)]
    stream_s = z.c_tokens / z.c_tps
    t0 = time.time() + 1.0
    starts = [t0 + z.c_spread_s * i / n for i in range(n)]
    deadline = t0 + z.c_spread_s + 4 * stream_s + 30
    before = bench.cpu()
    results: list[JobResult] = await asyncio.to_thread(
        gen.run, target, base, headers, agent, tags, starts, deadline
    )
    after = bench.cpu()
    stats = await bench.mock_get("/_mock/stats")
    received = await bench.received_at()
    streams = [s for r in results for s in r.streams]
    errors = _check(streams, z.c_tokens)
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
        "load_generator": {
            "processes": len(results),
            "cpu_s": sum(r.cpu_s for r in results),
            "busiest_process_utilisation": max(r.cpu_s / r.wall_s for r in results if r.wall_s),
            "loop_lag_ms": dist(lag),
            "wall_s": gen_wall,
        },
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


# --- D: delegate_parallel -----------------------------------------------------------------------------


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
