"""Scenario E's section of latest.md."""

from __future__ import annotations

from typing import Any

from bench.scenarios.appends.cases import SHAPES
from bench.tables import errors, num, skipped, table

TARGET_NAMES = {
    "trace_stream": "trace service, AppendMessageStream (one appender, two streams, shared by the writers)",
    "trace": "trace service, unary AppendMessages (one message)",
    "grpc_floor": "gRPC floor: health Check, same process",
    "store": "the store in-process, no gRPC",
    "raw_tx": "raw asyncpg, the old transaction",
    "raw_stmt": "raw asyncpg, the new statement",
    "raw_insert": "raw asyncpg, single INSERTs",
}


def markdown(s: dict[str, Any]) -> list[str]:
    """Scenario E's section of latest.md."""
    out = [f"## E: trace appends per second ({s.get('what', '')})", "", *skipped(s)]
    if "cases" not in s:
        return out
    by = {(c["backend"], c["target"], c["shape"]): c for c in s["cases"]}
    head = ["backend", "target", *(f"{shape} /s (p50 / p99 ms)" for shape in SHAPES), "errors", "check"]
    rows = []
    for backend in ("postgres", "sqlite"):
        for target in TARGET_NAMES:
            cells = [by.get((backend, target, shape)) for shape in SHAPES]
            if not any(cells):
                continue
            rows.append(
                [
                    backend,
                    TARGET_NAMES[target],
                    *(
                        "-"
                        if c is None
                        else f"{num(c['appends_per_s'], 0)} ({num(c['latency_ms'].get('p50'), 1)} / "
                        f"{num(c['latency_ms'].get('p99'), 1)})"
                        for c in cells
                    ),
                    errors({k: v for c in cells if c for k, v in c["errors"].items()}),
                    "ok" if all(c is None or c["check"] == "ok" for c in cells) else "FAILED",
                ]
            )
    out += table(head, rows)
    out += [
        "",
        "CPU per append (ms) of the trace process / this process (load generator, or the store) / "
        "PostgreSQL, and how busy the whole machine was (cores of 2, every process of every user):",
        "",
    ]
    cpu_rows = []
    for c in s["cases"]:
        p = c["cpu"]
        cpu_rows.append(
            [
                c["backend"],
                TARGET_NAMES[c["target"]],
                c["shape"],
                f"{num(p.get('trace_ms_per_append'), 3)} / {num(p.get('bench_ms_per_append'), 3)} / "
                f"{num(p.get('postgres_ms_per_append'), 3)}",
                num(p.get("machine_busy_cores"), 2),
            ]
        )
    out += table(["backend", "target", "shape", "CPU ms per append", "machine busy cores"], cpu_rows)
    g = s.get("goals") or {}
    out += [
        "",
        "Issue 17's goals on PostgreSQL, through AppendMessageStream: "
        f"sessions x writers: {num(g.get('sessions_per_s'), 0)}/s (goal {g.get('sessions_goal')}), "
        f"{num(g.get('sessions_of_raw_insert'), 2)} of raw single INSERTs "
        f"(goal {g.get('sessions_of_raw_insert_goal')}); "
        f"one session x writers: {num(g.get('one_session_per_s'), 0)}/s (goal {g.get('one_session_goal')}), "
        f"p99 {num(g.get('one_session_p99_ms'), 1)} ms (goal {g.get('one_session_p99_goal_ms')}); "
        f"unary AppendMessages: {num(g.get('unary_sessions_per_s'), 0)}/s and "
        f"{num(g.get('unary_one_session_per_s'), 0)}/s.",
        "",
    ]
    return out
