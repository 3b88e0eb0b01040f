"""`make bench` / `make bench-peers`: what the mesh adds to streamed replies, as ratios against the
same scripted model server read directly, measured in one run.

  A  2,000 tokens at top speed: completion ratio and added first delta vs the openai client direct,
     and vs the raw floor (plain httpx)
  B  200 tokens at 50 tok/s: added first delta, inter-delta gaps, lateness against the schedule
  C  N concurrent sessions at 20 tok/s (N = 50, 200, 500, 1,000; starts spread over 3 s): gap -
     pace, lateness, first delta, errors by code, CPU seconds of the mesh's processes per 1k tokens
  D  delegate_parallel with 8 subagents of 100 tokens at 50 tok/s: wall time over the slowest
     child's own model time
  S  (not in the default run) scale-out: C on PostgreSQL + Redis with one replica of each service,
     then with two each of gateway, orchestrator and agent-runtime (bench/scaleout.py)
  E  trace appends per second through the trace service on PostgreSQL (and SQLite) for three shapes,
     next to the gRPC floor and raw asyncpg ceilings measured in the same run (bench/scenarios/appends/)

With --peers langgraph, the LangGraph agent server (`langgraph dev`, in-memory, from its own
virtual environment) runs A, B and C in the same run against the same model server.

Writes OUT/latest.json, OUT/latest.md and OUT/*.png (OUT: bench/results, or
bench/results/quick with --quick so that a quick run never replaces the full run's files).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import psutil

from bench import procs
from bench.harness import QUICK, Bench, Sizes, idle_cpu, write_rules
from bench.scenarios import federation
from bench.scenarios.appends import cases as appends
from bench.scenarios.concurrent import scenario_c
from bench.scenarios.multiagent import scenario_d, scenario_f
from bench.scenarios.streaming import scenario_a, scenario_b

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
WORK = ROOT / ".agentmesh" / "bench"
ALL = ("A", "B", "C", "D", "E", "F", "G")  # the default run
OPTIONAL = ("S",)  # run only when named in --scenarios
PEER_SCENARIOS = ("A", "B", "C")  # the scenarios that run the peers beside the mesh


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu or platform.processor(),
        "cores": psutil.cpu_count(logical=True),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "system": platform.platform(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions(peers_venv: Path | None) -> dict[str, str]:
    out: dict[str, str] = {}
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        out["agentmesh"] = rev + ("+dirty" if dirty.stdout.strip() else "")
    if peers_venv is not None:
        names = ["langgraph", "langgraph-api", "langgraph-runtime-inmem", "langgraph-cli", "langchain-openai"]
        code = (
            f"import importlib.metadata as m, json; print(json.dumps({{p: m.version(p) for p in {names}}}))"
        )
        with contextlib.suppress(OSError, subprocess.CalledProcessError, ValueError):
            res = subprocess.run(
                [str(procs.peers_python(peers_venv)), "-c", code], capture_output=True, text=True, check=True
            )
            out.update(json.loads(res.stdout))
    return out


def log_findings(proc: procs.Proc) -> dict[str, Any]:
    """What a target logged at WARNING and up, plus failed turns (INFO `turn failed`, seen with
    --mesh-log-level INFO), counted by service, message and error (numbers and ids masked)."""
    counts: Counter[str] = Counter()

    def mask(text: str) -> str:
        return re.sub(r"[0-9a-f]{8}-[0-9a-f-]{27,}|[0-9a-f]{32}|\b\d+(\.\d+)?\b", "#", text)[:240]

    with contextlib.suppress(OSError):
        for line in proc.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                level = str(rec.get("level", "")).lower()
                if level in ("warning", "error", "critical") or "failed" in str(rec.get("msg", "")):
                    detail = " ".join(str(rec[k]) for k in ("code", "error", "exc") if rec.get(k))
                    last = detail.strip().splitlines()[-1] if detail.strip() else ""
                    key = f"{rec.get('service', '?')} {level} {rec.get('msg', '')}: {last}"
                    counts[mask(key)] += 1
            elif re.search(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback", line):
                counts[mask(re.sub(r"^\S+\s+\S+\s+", "", line))] += 1
    return {"lines": sum(counts.values()), "top": dict(counts.most_common(12))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a couple of minutes in all")
    p.add_argument("--scenarios", default=",".join(ALL), help="comma-separated subset of A,B,C,D,E,F,G, or S")
    p.add_argument("--sessions", help="scenario C's N values, e.g. 50,200 (full: 50,200,500,1000)")
    p.add_argument("--peers", default="", help="peer servers to run too: langgraph")
    p.add_argument(
        "--peers-venv", type=Path, default=ROOT / ".venv-peers", help="the peers' virtual environment"
    )
    p.add_argument(
        "--targets", default="", help="a subset of direct,mesh,langgraph (diagnosis; ratios need direct)"
    )
    p.add_argument("--scale-replicas", type=int, default=2, help="S: replicas of the replicated services")
    p.add_argument("--scale-services", default="gateway,orchestrator,agent-runtime",
                   help="S: the services replicated (stream may be one; trace runs once)")  # fmt: skip
    p.add_argument("--load-procs", default="auto", help="C's load generator processes: a number, or auto")
    p.add_argument("--out", type=Path, help="results directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--mesh-log-level", default="WARNING", help="AGENTMESH_LOG_LEVEL of the mesh (its log: "
                   ".agentmesh/bench/mesh.log)")  # fmt: skip
    p.add_argument(
        "--idle-s", type=float, default=5.0, help="seconds of idle CPU measured before the scenarios"
    )
    for f in fields(Sizes):
        if f.name == "c_sessions":
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = float if f.type in ("float", float) else int
        p.add_argument(flag, type=kind, dest=f.name, help=f"(full run: {f.default})")
    p.add_argument("--e-database-url", default=os.environ.get("TEST_DATABASE_URL", ""))
    return p.parse_args(argv)


def sizes_from(args: argparse.Namespace) -> Sizes:
    sizes = Sizes()
    if args.quick:
        for key, value in QUICK.items():
            setattr(sizes, key, value)
    for f in fields(Sizes):
        value = getattr(args, f.name, None)
        if value is not None:
            setattr(sizes, f.name, value)
    if args.sessions:
        sizes.c_sessions = [int(x) for x in args.sessions.split(",") if x.strip()]
    return sizes


async def run_scenarios(bench: Bench, selected: list[str], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    steps = {"A": scenario_a, "B": scenario_b, "C": scenario_c, "D": scenario_d, "F": scenario_f}
    last_with_peers = max((i for i, name in enumerate(selected) if name in PEER_SCENARIOS), default=-1)
    for i, name in enumerate(selected):
        if i > last_with_peers and bench.peers:
            # The peers are in A, B and C only: a peer still working through runs its clients gave up
            # on (C at N = 1,000) must not burn the cores the mesh's later scenarios are measured on.
            for proc in bench.peers.values():
                proc.stop()
            bench.peers = {}
        started = time.time()
        print(f"scenario {name} ...", flush=True)
        if await bench.wait_quiet() is None:
            print("  warning: a target still burns CPU from the scenario before", flush=True)
        try:
            if name == "E":
                z = bench.sizes
                ctx = appends.Context(args.e_database_url, WORK / "e", z.e_appends, z.e_writers)
                out["E"] = await appends.run(ctx)
            elif name == "S":
                from bench import scaleout

                out["S"] = await scaleout.scenario_s(bench, args, WORK / "s", HERE / "catalog.yaml")
            elif name == "G":
                out["G"] = await federation.run(5 if args.quick else 20, WORK / "g")
            else:
                out[name] = await steps[name](bench)
        except Exception as exc:
            traceback.print_exc()
            out[name] = {"failed": f"{type(exc).__name__}: {exc}"}
        out[name]["duration_s"] = round(time.time() - started, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = sizes_from(args)
    selected = [s.strip().upper() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(selected) - set(ALL + OPTIONAL)
    if unknown:
        print(f"unknown scenarios {sorted(unknown)}; choose from {','.join(ALL + OPTIONAL)}", file=sys.stderr)
        return 2
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if set(peers) - {"langgraph"}:
        print(f"unknown peers {peers}; the one peer is langgraph", file=sys.stderr)
        return 2
    out_dir = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    fd_limit = procs.raise_fd_limit()
    started = time.time()
    result: dict[str, Any] = {
        "command": "python -m bench.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "machine": machine() | {"fd_limit": fd_limit},
        "versions": versions(args.peers_venv if peers else None),
        "sizes": asdict(sizes),
        "scenarios_selected": selected,
        "targets": ["direct", "mesh", *peers],
    }
    print(f"machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, "
          f"{result['machine']['ram_gib']} GiB, Python {result['machine']['python']}, "
          f"load average {result['machine']['load_average_at_start']}", flush=True)  # fmt: skip
    WORK.mkdir(parents=True, exist_ok=True)
    rules = write_rules(WORK / "rules.yaml", sizes)
    started_procs: list[procs.Proc] = []
    try:
        mock = procs.start_mock(WORK, rules)
        started_procs.append(mock)
        mesh = procs.start_mesh(WORK, mock.url, HERE / "catalog.yaml", args.mesh_log_level)
        started_procs.append(mesh)
        peer_procs: dict[str, procs.Proc] = {}
        if "langgraph" in peers:
            jobs = max(sizes.c_sessions) if "C" in selected else 10
            peer_procs["langgraph"] = procs.start_langgraph(WORK, args.peers_venv, mock.url, jobs)
            started_procs.append(peer_procs["langgraph"])
            result["langgraph_n_jobs_per_worker"] = jobs
        only = [t.strip() for t in args.targets.split(",") if t.strip()]
        bench = Bench(
            sizes=sizes, mock=mock, mesh=mesh, peers=peer_procs, load_procs=args.load_procs, only=only
        )
        if args.idle_s > 0:
            time.sleep(2.0)  # let start-up work settle
            result["idle_cpu_cores"] = asyncio.run(idle_cpu(bench, args.idle_s))
        result["scenarios"] = asyncio.run(run_scenarios(bench, selected, args))
        result["logs"] = {p.name: log_findings(p) for p in started_procs}
    finally:
        for proc in reversed(started_procs):
            proc.stop()
    result["machine"]["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    result["duration_s"] = round(time.time() - started, 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(result, indent=1) + "\n")
    from bench import report

    text = report.markdown(result)
    (out_dir / "latest.md").write_text(text)
    print()
    print(text)
    if not args.no_plots:
        try:
            from bench import plots

            for path in plots.write_all(result, out_dir):
                print(f"wrote {path}")
        except ImportError as exc:
            print(f"no plots ({exc}): install the bench extra (pip install -e '.[bench]')", file=sys.stderr)
    print(f"wrote {out_dir / 'latest.json'} and {out_dir / 'latest.md'} in {result['duration_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
