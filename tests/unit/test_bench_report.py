"""bench.report's table of scenario C shows, beside the target's CPU, what the model server (one SSE
writer) and the load generator (one reader) spent per 1,000 tokens in the same phase: the floor the
mesh's per-token cost is read against (docs/benchmarks.md, "Goals not reached")."""

from __future__ import annotations

from typing import Any

from bench.report import section_c


def phase(target: str, tokens: int, load_cpu_s: float) -> dict[str, Any]:
    return {
        "target": target,
        "n": 2,
        "ok": 2,
        "errors": {},
        "tokens": tokens,
        "model_max_in_flight": 2,
        "cpu": {"mock": {"per_1k_tokens_s": 0.104}, "machine_busy_cores": 1.5},
        "load_generator": {"processes": 1, "cpu_s": load_cpu_s, "busiest_process_utilisation": 0.4},
    }


def test_the_c_table_has_the_load_generators_cpu_per_1k_tokens() -> None:
    lines = section_c({"what": "C", "phases": [phase("direct", 12_000, 3.0), phase("direct", 0, 1.0)]})
    head = next(line for line in lines if line.startswith("| N |"))
    columns = [c.strip() for c in head.strip("|").split("|")]
    at = columns.index("load gen CPU s / 1k tok")
    assert columns[at - 1] == "model server CPU s / 1k tok"
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines if line.startswith("| 2 |")]
    assert [row[at] for row in rows] == ["0.250", "-"]  # no tokens: no figure, not a division by zero
    assert rows[0][at - 1] == "0.104"
