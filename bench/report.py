"""latest.json -> latest.md: the same figures as Markdown tables (also printed at the end of a run).

`python -m bench.report bench/results/latest.json` rewrites the tables from a result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from bench.tables import errors, get, num, skipped, table

MESH_PROCESSES = ("gateway", "orchestrator", "agent-runtime", "stream", "trace", "up")


def _settled(s: dict[str, Any]) -> str:
    """How long turns waited for the turn before them to be over (runs before it was measured: none)."""
    waits = s.get("settle_ms")
    if not waits:
        return ""
    parts = ", ".join(
        f"{t} p50 {num(w.get('p50'))} / max {num(w.get('max'))} ms" for t, w in waits.items() if w.get("n")
    )
    why = "no thread of its processes running"
    return f", each turn once the one before it was over ({why}; waited after {parts})"


def section_a(s: dict[str, Any]) -> list[str]:
    out = [f"## A: {s.get('what', '')}", "", *skipped(s)]
    if "targets" not in s:
        return out
    turns = f"{s['turns']} turns after {s['warmup']} warm-up, targets interleaved turn by turn"
    out.append(turns + _settled(s) + ".")
    out.append("")
    rows = []
    for target, t in s["targets"].items():
        rows.append(
            [
                target,
                num(get(t, "completion_ms", "p50")),
                num(get(t, "completion_ms", "p99")),
                num(get(t, "completion_ratio", "p50"), 2, "x"),
                num(get(t, "completion_ratio", "p99"), 2, "x"),
                num(get(t, "streaming_ratio", "p50"), 2, "x"),
                num(get(t, "first_delta_ms", "p50")),
                num(get(t, "added_first_delta_ms", "p50")),
                num(get(t, "added_first_delta_ms", "p99")),
                num(get(t, "completion_ratio_vs_raw", "p50"), 2, "x"),
                num(get(t, "added_first_delta_vs_raw_ms", "p50")),
                num(get(s, "cpu", target, "per_1k_tokens_s"), 3),
                errors(t.get("errors")),
            ]
        )
    head = ["target", "completion p50 ms", "p99", "ratio vs direct p50", "p99",
            "ratio after the first delta p50", "first delta p50 ms",
            "added first delta p50 ms", "p99", "ratio vs raw p50", "added vs raw p50 ms",
            "CPU s / 1k tokens", "errors"]  # fmt: skip
    return [*out, *table(head, rows), ""]


def section_b(s: dict[str, Any]) -> list[str]:
    out = [f"## B: {s.get('what', '')}", "", *skipped(s)]
    if "targets" not in s:
        return out
    turns = f"{s['turns']} turns after {s['warmup']} warm-up, targets interleaved turn by turn"
    out.append(turns + _settled(s) + ".")
    out.append("")
    rows = []
    for target, t in s["targets"].items():
        rows.append(
            [
                target,
                num(get(t, "first_delta_ms", "p50")),
                num(get(t, "first_delta_ms", "p99")),
                num(get(t, "added_first_delta_ms", "p50")),
                num(get(t, "added_first_delta_ms", "p99")),
                num(get(t, "added_first_delta_vs_raw_ms", "p50")),
                num(get(t, "to_model_ms", "p50")),
                num(get(t, "gap_ms", "p50")),
                num(get(t, "gap_ms", "p99")),
                num(get(t, "gap_minus_pace_ms", "p99")),
                num(get(t, "lateness_ms", "p50")),
                num(get(t, "lateness_ms", "p99")),
                errors(t.get("errors")),
            ]
        )
    head = ["target", "first delta p50 ms", "p99", "added first delta p50 ms", "p99",
            "added vs raw p50 ms", "request -> model p50 ms", "gap p50 ms",
            "gap p99 ms", "gap - pace p99 ms", "lateness p50 ms", "p99", "errors"]  # fmt: skip
    return [*out, *table(head, rows), ""]


LAG_LIMIT_MS = 50.0


def _lagged(lg: dict[str, Any]) -> bool:
    lag = get(lg, "loop_lag_ms", "p99")
    return isinstance(lag, float) and lag > LAG_LIMIT_MS


def section_c(s: dict[str, Any]) -> list[str]:
    out = [f"## C: {s.get('what', '')}", "", *skipped(s)]
    phases = s.get("phases") or []
    if not phases:
        return out
    rows, cpu_rows, turn_rows = [], [], []
    for p in phases:
        target = p["target"]
        lg = p["load_generator"]
        rows.append(
            [
                str(p["n"]),
                target + (" (not quiet before)" if "settle_s" in p and p["settle_s"] is None else ""),
                f"{p['ok']}/{p['n']}",
                errors(p["errors"]),
                num(get(p, "first_delta_ms", "p50")),
                num(get(p, "first_delta_ms", "p99")),
                num(get(p, "to_model_ms", "p50")),
                num(get(p, "to_model_ms", "p99")),
                num(get(p, "gap_minus_pace_ms", "p50")),
                num(get(p, "gap_minus_pace_ms", "p99")),
                num(get(p, "lateness_ms", "p50")),
                num(get(p, "lateness_ms", "p99")),
                num(get(p, "cpu", target, "per_1k_tokens_s"), 3),
                num(get(p, "cpu", "mock", "per_1k_tokens_s"), 3),
                num(1000 * lg["cpu_s"] / p["tokens"] if p.get("tokens") else None, 3),
                str(p["model_max_in_flight"]),
                f"{lg['processes']} / {lg['busiest_process_utilisation']:.0%} / "
                f"{num(get(lg, 'loop_lag_ms', 'p99'))}" + (" (!)" if _lagged(lg) else ""),
                num(get(p, "cpu", "machine_busy_cores"), 2),
            ]
        )
        if target == "mesh":
            by = get(p, "cpu", "mesh", "by_process_per_1k_tokens_s") or {}
            cpu_rows.append([str(p["n"]), *(num(by.get(k), 3) for k in MESH_PROCESSES),
                             num(get(p, "cpu", "mesh", "per_1k_tokens_s"), 3)])  # fmt: skip
            turn = p.get("per_turn") or {}
            ms = turn.get("cpu_ms") or {}
            turn_rows.append([str(p["n"]), *(num(ms.get(k), 1) for k in MESH_PROCESSES),
                              num(turn.get("cpu_ms_total"), 1), num(turn.get("rpcs_total"), 1)])  # fmt: skip
    head = ["N", "target", "ok", "errors", "first delta p50 ms", "p99", "request -> model p50 ms", "p99",
            "gap - pace p50 ms", "p99",
            "lateness p50 ms", "p99", "target CPU s / 1k tok", "model server CPU s / 1k tok",
            "load gen CPU s / 1k tok", "model max in flight", "load gen procs / busiest / lag p99 ms",
            "machine busy cores"]  # fmt: skip
    out += table(head, rows)
    if any(_lagged(p["load_generator"]) for p in phases):
        out += [
            "",
            f"(!) the load generator's event loop lagged more than {LAG_LIMIT_MS:g} ms (p99) in this "
            "phase: the machine (or the load generator) limited the pace, not only the target.",
        ]
    failed = [(p, code, d) for p in phases for code, d in (p.get("error_detail") or {}).items()]
    if failed:
        out += ["", "Errors: after how long (request -> error) and how much text had arrived:", ""]
        out += table(
            ["N", "target", "code", "count", "after p50 s", "max s", "had text", "tokens p50"],
            [[str(p["n"]), p["target"], code, str(d["count"]), num(get(d, "after_s", "p50"), 2),
              num(get(d, "after_s", "max"), 2), str(d["with_text"]), num(d["tokens_p50"], 0)]
             for p, code, d in failed],
        )  # fmt: skip
    out += ["", "Mesh CPU seconds per 1,000 tokens by process:", ""]
    out += table(["N", *MESH_PROCESSES, "total"], cpu_rows)
    out += ["", "A turn of the mesh: CPU milliseconds by process (its tokens included) and the RPCs its "
            "services started (lease renewals and health checks left out):", ""]  # fmt: skip
    out += table(["N", *MESH_PROCESSES, "CPU ms", "RPCs"], turn_rows)
    return [*out, ""]


def section_d(s: dict[str, Any]) -> list[str]:
    out = [f"## D: {s.get('what', '')}", "", *skipped(s)]
    if "p50" not in s:
        return out
    p = s["p50"]
    out.append(
        f"{s['turns']} turns after {s['warmup']} warm-up; the slowest child's own model time is "
        f"{num(s['slowest_child_model_s'], 2)} s (its token count and pace); times from the model "
        "server's request log."
    )
    out.append("")
    head = ["wall p50 s", "wall / slowest child p50", "max", "post -> first child s", "child start spread s",
            "last child's end -> supervisor's next call s", "that call -> done s", "errors"]  # fmt: skip
    row = [num(p["wall_s"], 2), num(p["ratio"], 2, "x"), num(s.get("max_ratio"), 2, "x"),
           num(p["to_first_child_s"], 3), num(p["child_start_spread_s"], 3), num(p["fan_in_s"], 3),
           num(p["tail_s"], 3), errors(s.get("errors"))]  # fmt: skip
    return [*out, *table(head, [row]), ""]


def section_f(s: dict[str, Any]) -> list[str]:
    out = [f"## F: {s.get('what', '')}", "", *skipped(s)]
    if "local_ms" not in s:
        return out
    out.append(
        f"{s['turns']} turns of each after {s['warmup']} warm-up, interleaved; "
        "a turn: POST /api/chat -> done."
    )
    out.append("")
    head = ["callee", "turn p50 ms", "turn p99 ms", "n"]
    rows = [
        ["local (child turn)", num(get(s, "local_ms", "p50"), 1), num(get(s, "local_ms", "p99"), 1),
         str(get(s, "local_ms", "n"))],
        ["remote (over A2A)", num(get(s, "remote_ms", "p50"), 1), num(get(s, "remote_ms", "p99"), 1),
         str(get(s, "remote_ms", "n"))],
        ["added by A2A", num(get(s, "added_ms", "p50"), 1), num(get(s, "added_ms", "p99"), 1), ""],
    ]  # fmt: skip
    return [*out, *table(head, rows), f"errors: {errors(s.get('errors'))}", ""]


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        "# agentmesh benchmark results"
        + (" (QUICK run: small sizes, not for quoting)" if r.get("quick") else ""),
        "",
        f"- run: {r['started_at']}, `{r['command']}`, {num(r.get('duration_s'), 0)} s",
        f"- machine: {m['cpu']}, {m['cores']} logical cores ({m.get('physical_cores')} physical), "
        f"{m['ram_gib']} GiB RAM, Python {m['python']}, Linux {m['kernel']}; load average "
        f"{m.get('load_average_at_start')} at start, {m.get('load_average_at_end')} at end",
        f"- versions: {', '.join(f'{k} {v}' for k, v in r.get('versions', {}).items())}",
        f"- targets: {', '.join(r['targets'])} (direct = the same model server read straight with the "
        "openai client, the baseline; A and B also read it with plain httpx, `raw`: the floor)",
    ]
    idle = r.get("idle_cpu_cores")
    if idle:
        parts = [f"{t} {num(get(idle, t, 'total'), 3)}" for t in r["targets"] if t != "direct"]
        lines.append(
            f"- idle CPU before the scenarios ({idle['seconds']} s, cores): {', '.join(parts)}, "
            f"model server {num(idle.get('mock'), 3)}"
        )
    lines.append("")
    sc = r.get("scenarios", {})
    sections = (("A", section_a), ("B", section_b), ("C", section_c), ("D", section_d), ("F", section_f))
    for name, fn in sections:
        if name in sc:
            lines += fn(sc[name])
    if "E" in sc:
        from bench.scenarios.appends import report as appends

        lines += appends.markdown(sc["E"])
    if "G" in sc:
        from bench.scenarios import federation

        lines += federation.markdown(sc["G"])
    if "S" in sc:
        from bench import scaleout

        lines += scaleout.markdown(sc["S"])
    logs = {**(r.get("logs") or {}), **(get(sc, "S", "logs") or {})}
    noisy = {k: v for k, v in logs.items() if v.get("lines")}
    if noisy:
        lines += ["## Warnings and errors in the logs", ""]
        for name, v in noisy.items():
            lines.append(f"- {name}: {v['lines']} lines")
            lines += [f"  - x{n} `{msg}`" for msg, n in v["top"].items()]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest.json")
    result = json.loads(path.read_text())
    path.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
