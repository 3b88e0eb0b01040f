"""Where the mesh's CPU goes under a paced load: py-spy on every process of `agentmesh up`.

Starts the scripted model server and `agentmesh up --no-mock-llm` as the bench does (procs.py), drives
N sessions of T tokens at R tokens/s through POST /api/chat with the bench's load generator, and samples
each service's Python stacks with `py-spy record` (collapsed stacks, idle frames dropped) meanwhile.
Prints the CPU seconds per 1,000 tokens by service and each service's top frames: by self time (the
innermost Python function on the stack) and by inclusive time (anywhere on the stack), as shares of
its samples. gRPC's poller thread is left out of the shares (py-spy counts its waits as work,
flames.POLLER); what the threads beside the event loop's take is read from /proc instead. Writes the
collapsed stacks to OUT/<service>.txt (flamegraph.pl or speedscope read them).

    .venv/bin/python -m bench.profile --sessions 20 --tokens 300 --tps 20
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench import flames, procs
from bench.harness import Bench, Sizes, cpu_report, write_rules
from bench.loadgen import LoadGenerator
from bench.procs import _label

HERE = Path(__file__).resolve().parent
WORK = HERE.parent / ".agentmesh" / "bench-profile"


def top_frames(collapsed: Path, count: int = 15) -> dict[str, Any]:
    """Self and inclusive shares of the samples in a py-spy `raw` (collapsed stacks) file."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for stack, n in flames.stacks(collapsed):
        frames = [flames.short(p, parts=2) for p in stack]
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    share = (lambda c: [(f, round(100 * v / total, 1)) for f, v in c.most_common(count)]) if total else None
    return {
        "samples": total,
        "self_pct": share(own) if share else [],
        "inclusive_pct": share(inclusive) if share else [],
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--sessions", type=int, default=20, help="concurrent sessions")
    p.add_argument("--tokens", type=int, default=300, help="tokens per reply")
    p.add_argument("--tps", type=float, default=20.0, help="the model's pace, tokens per second")
    p.add_argument("--spread-s", type=float, default=2.0, help="starts spread over this many seconds")
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--out", type=Path, default=WORK / "out")
    p.add_argument("--no-spy", action="store_true", help="CPU figures only")
    p.add_argument("--compare", type=Path, help="another checkout, set up (make setup), to run first, "
                   "under the same load and model server: before/after in one run")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="with --compare: base, this, base, this, ...")
    p.add_argument("--flames", type=Path, help="write a flame graph per process of this checkout's mesh "
                   "here (flame-<service>.png)")  # fmt: skip
    return p.parse_args(argv)


ThreadCpu = dict[str, tuple[float, float]]


def thread_cpu(mesh: procs.Proc) -> ThreadCpu:
    """Per service: the CPU seconds of its main thread (the event loop's) and of its other threads (gRPC's
    poller above all, whose samples py-spy cannot tell from its waits: flames.POLLER), those that ended
    too (the process's CPU counts them, its live threads' do not)."""
    out: ThreadCpu = {}
    for proc in mesh.processes():
        label = _label(proc.cmdline())
        if label in ("", "up"):
            continue
        main = next((t.user_time + t.system_time for t in proc.threads() if t.id == proc.pid), 0.0)
        cpu = proc.cpu_times()
        out[label] = (main, max(cpu.user + cpu.system - main, 0.0))
    return out


def thread_shares(before: ThreadCpu, after: ThreadCpu) -> dict[str, float]:
    """Per service: its other threads' share of its CPU between the two readings, in %."""
    shares: dict[str, float] = {}
    for label, (main, other) in after.items():
        main -= before.get(label, (0.0, 0.0))[0]
        other -= before.get(label, (0.0, 0.0))[1]
        if main + other > 0:
            shares[label] = round(100 * other / (main + other), 1)
    return shares


def profile_mesh(args: argparse.Namespace, spy: str, mock: procs.Proc, gen: LoadGenerator, name: str,
                 root: Path | None) -> dict[str, Any]:  # fmt: skip
    """One mesh (this checkout, or `root`) under the load, py-spy on each of its services."""
    sizes = Sizes(c_sessions=[args.sessions], c_tokens=args.tokens, c_tps=args.tps, c_spread_s=args.spread_s)
    out_dir = args.out / name
    out_dir.mkdir(parents=True, exist_ok=True)
    mesh = procs.start_mesh(WORK / name, mock.url, HERE / "catalog.yaml", root=root)
    try:
        bench = Bench(sizes=sizes, mock=mock, mesh=mesh, peers={})
        headers = {"Authorization": f"Bearer {mesh.extra['key']}"}
        time.sleep(2.0)
        # Warm-up: one turn through every process, so imports and first connections are not profiled.
        t = time.time()
        gen.run("mesh", [mesh.url], headers, "plain", [f"bench-c warm {name}"], [t], t + 60)
        stream_s = args.tokens / args.tps
        t0 = time.time() + 1.0
        starts = [t0 + args.spread_s * i / args.sessions for i in range(args.sessions)]
        deadline = t0 + args.spread_s + 4 * stream_s + 30
        spies: list[tuple[str, subprocess.Popen[bytes], Path]] = []
        if not args.no_spy:
            for proc in mesh.processes():
                label = _label(proc.cmdline())
                if label in ("", "up"):
                    continue
                out = out_dir / f"{label}.txt"
                cmd = [spy, "record", "--pid", str(proc.pid), "--format", "raw", "--rate", str(args.rate),
                       "--duration", str(int(args.spread_s + stream_s + 1)), "--nonblocking",
                       "--output", str(out)]  # fmt: skip
                popen = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                spies.append((label, popen, out))
        before, threads_before = bench.cpu(), thread_cpu(mesh)
        tags = [f"bench-c prof {name} {i}" for i in range(args.sessions)]
        results = gen.run("mesh", [mesh.url], headers, "plain", tags, starts, deadline)
        after, threads_after = bench.cpu(), thread_cpu(mesh)
        for _, popen, _ in spies:
            popen.wait(60)
    finally:
        mesh.stop()
    streams = [s for r in results for s in r.streams]
    tokens = sum(s.token_count for s in streams)
    first = sorted(s.first - s.start for s in streams if s.first)
    return {
        "mesh": name,
        "root": str(root or HERE.parent),
        "sessions": args.sessions,
        "tokens": tokens,
        "errors": dict(Counter(s.error for s in streams if s.error)),
        "first_delta_ms_p50": round(1000 * first[len(first) // 2], 1) if first else None,
        "cpu": cpu_report(before, after, {"mesh": tokens})["mesh"],
        "frames": {label: top_frames(out) for label, _, out in spies if out.exists()},
        "other_threads_pct": thread_shares(threads_before, threads_after),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not args.no_spy and not Path(spy).exists():
        print("py-spy is missing: pip install -e '.[dev]'", file=sys.stderr)
        return 2
    procs.raise_fd_limit()
    sizes = Sizes(c_sessions=[args.sessions], c_tokens=args.tokens, c_tps=args.tps, c_spread_s=args.spread_s)
    WORK.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    meshes: list[tuple[str, Path | None]] = [("this", None)]
    if args.compare is not None:
        meshes = [("base", args.compare.resolve()), ("this", None)] * args.rounds
    mock = procs.start_mock(WORK, write_rules(WORK / "rules.yaml", sizes))
    reports: list[dict[str, Any]] = []
    try:
        gen = LoadGenerator(1 if args.sessions <= 250 else 2)
        try:
            for name, root in meshes:
                reports.append(profile_mesh(args, spy, mock, gen, name, root))
        finally:
            gen.close()
    finally:
        mock.stop()
    (args.out / "profile.json").write_text(json.dumps(reports, indent=1) + "\n")
    for report in reports:
        cpu = report["cpu"]
        print(f"\n### {report['mesh']} ({report['root']}): {args.sessions} sessions x {args.tokens} tokens "
              f"at {args.tps:g}/s: {report['tokens']} tokens, errors {report['errors'] or '-'}, "
              f"first delta p50 {report['first_delta_ms_p50']} ms")  # fmt: skip
        print(f"mesh CPU per 1,000 tokens: {cpu['per_1k_tokens_s']:.3f} s  " + "  ".join(
            f"{k} {v:.3f}" for k, v in cpu["by_process_per_1k_tokens_s"].items()))  # fmt: skip
        for label, frames in report["frames"].items():
            others = report["other_threads_pct"].get(label)
            print(f"== {label}: {frames['samples']} samples; threads beside the event loop: {others} %")
            print("  self:      " + "; ".join(f"{f} {p}%" for f, p in frames["self_pct"][:10]))
    print(f"\nwrote {args.out}/profile.json and the collapsed stacks ({args.out}/<mesh>/<service>.txt)")
    if args.flames is not None and not args.no_spy:
        for stacks in sorted((args.out / "this").glob("*.txt")):
            title = f"{stacks.stem}, {args.sessions} sessions x {args.tokens} tokens at {args.tps:g}/s"
            written = flames.draw(flames.tree(stacks), args.flames / f"flame-{stacks.stem}.png", title)
            if written is not None:
                print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
