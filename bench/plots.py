"""Plots of a bench result (matplotlib, PNG): latency distributions (A, B), CPU per token (A, C) and
gaps, lateness and first delta against N (C).

`python -m bench.plots bench/results/latest.json` redraws them from a result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter, ScalarFormatter

from bench.report import MESH_PROCESSES

COLORS = {"direct": "#7f7f7f", "raw": "#bcbd22", "mesh": "#1f77b4", "langgraph": "#d62728"}


def _ecdf(ax: Any, values: list[float], label: str, color: str | None) -> None:
    if not values:
        return
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post", label=f"{label} (n={len(xs)})", color=color)


def _plain(axis: Any) -> None:
    """Plain numbers on a log axis, no labels on minor ticks."""
    axis.set_major_formatter(ScalarFormatter())
    axis.set_minor_formatter(NullFormatter())


def _title(r: dict[str, Any]) -> str:
    m = r["machine"]
    quick = " — QUICK run" if r.get("quick") else ""
    return f"{m['cpu']}, {m['cores']} cores, Python {m['python']}, {r['started_at'][:10]}{quick}"


def latency(r: dict[str, Any], path: Path) -> Path | None:
    sc = r.get("scenarios", {})
    panels = [
        ("A", "completion_ms", "A: completion (ms)"),
        ("A", "first_delta_ms", "A: first delta (ms)"),
        ("B", "first_delta_ms", "B: first delta (ms)"),
        ("B", "gap_ms", "B: gap between deltas (ms)"),
    ]
    panels = [p for p in panels if "samples" in sc.get(p[0], {})]
    if not panels:
        return None
    cols = 2 if len(panels) > 1 else 1
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.0 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (name, key, title) in zip(axes.flat, panels, strict=False):
        for target, samples in sc[name]["samples"].items():
            _ecdf(ax, samples.get(key, []), target, COLORS.get(target))
        ax.set_title(title)
        ax.set_xscale("log")
        _plain(ax.xaxis)
        ax.set_ylabel("fraction ≤ x")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency distributions (ECDF) — " + _title(r), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _c_phases(r: dict[str, Any]) -> list[dict[str, Any]]:
    return list(r.get("scenarios", {}).get("C", {}).get("phases") or [])


def cpu_per_token(r: dict[str, Any], path: Path) -> Path | None:
    """Stacked bars: the mesh's CPU seconds per 1,000 tokens by process; the peer's beside it."""
    groups: list[tuple[str, dict[str, Any], str]] = []  # (label, cpu report, target)
    a = r.get("scenarios", {}).get("A", {})
    for target in r["targets"]:
        if target != "direct" and "cpu" in a:
            groups.append(("A top speed", a["cpu"], target))
    for p in _c_phases(r):
        if p["target"] != "direct":
            groups.append((f"C N={p['n']}", p["cpu"], p["target"]))
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(groups) + 2), 4.2))
    shades = plt.get_cmap("Blues")
    seen: set[str] = set()
    for x, (_label, cpu, target) in enumerate(groups):
        entry = cpu.get(target) or {}
        if target == "mesh":
            bottom = 0.0
            for i, proc in enumerate(MESH_PROCESSES):
                value = (entry.get("by_process_per_1k_tokens_s") or {}).get(proc, 0.0)
                name = f"mesh: {proc}"
                ax.bar(x, value, bottom=bottom, color=shades(0.85 - 0.12 * i),
                       label=None if name in seen else name)  # fmt: skip
                seen.add(name)
                bottom += value
        else:
            value = entry.get("per_1k_tokens_s") or 0.0
            ax.bar(x, value, color=COLORS.get(target, "#d62728"), label=None if target in seen else target)
            seen.add(target)
    ax.set_xticks(range(len(groups)), [f"{g[0]}\n{g[2]}" for g in groups], fontsize=7)
    ax.set_ylabel("CPU seconds per 1,000 tokens")
    ax.set_title(
        "CPU per token (the target's processes; model server and load generator excluded)", fontsize=9
    )
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(_title(r), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gap_vs_n(r: dict[str, Any], path: Path) -> Path | None:
    phases = _c_phases(r)
    if not phases:
        return None
    panels = [
        ("gap_minus_pace_ms", "gap - pace (ms)"),
        ("lateness_ms", "lateness vs the model's schedule (ms)"),
        ("first_delta_ms", "first delta (ms)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.8))
    for ax, (key, title) in zip(axes, panels, strict=True):
        for target in r["targets"]:
            ps = sorted((p for p in phases if p["target"] == target), key=lambda p: p["n"])
            ns = [p["n"] for p in ps]
            color = COLORS.get(target)
            for q, style in (("p99", "-"), ("p50", "--")):
                ys = [p[key].get(q, float("nan")) for p in ps]
                ax.plot(ns, ys, style, marker="o", color=color, label=f"{target} {q}")
            for p in ps:
                if p["errors"]:
                    ax.annotate(f"{sum(p['errors'].values())} err", (p["n"], p[key].get("p99", 0)),
                                fontsize=7, color=color)  # fmt: skip
        ns = sorted({p["n"] for p in phases})
        ax.set_xscale("log")
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.xaxis.set_minor_formatter(NullFormatter())
        if key == "gap_minus_pace_ms":
            ax.set_yscale("symlog", linthresh=1.0)  # a burst's gaps fall below the pace: negative values
        else:
            ax.set_yscale("log")
        ax.set_xlabel("concurrent sessions N")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("Scenario C against N — " + _title(r), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(r: dict[str, Any], out_dir: Path) -> list[Path]:
    made = [
        latency(r, out_dir / "latency.png"),
        cpu_per_token(r, out_dir / "cpu_per_token.png"),
        gap_vs_n(r, out_dir / "gap_vs_n.png"),
    ]
    return [p for p in made if p is not None]


if __name__ == "__main__":
    src = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest.json")
    for p in write_all(json.loads(src.read_text()), src.parent):
        print(f"wrote {p}")
