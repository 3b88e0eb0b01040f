"""What scenario E measures besides the rate: CPU seconds of the trace process, this process and
PostgreSQL over a case, and the rows counted in the database afterwards."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import asyncpg
import psutil


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads, to the nanosecond (/proc/PID/task/*/schedstat):
    psutil's clock ticks (10 ms) would round 50 backends' few milliseconds each to nothing."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(OSError, ValueError, IndexError):
                total += int((task / "schedstat").read_text().split()[0])
    except OSError:
        return 0.0
    return total / 1e9


def _postgres_cpu() -> dict[int, float]:
    """CPU seconds of each PostgreSQL server process on this machine (postmaster, backends, writers)."""
    out: dict[int, float] = {}
    for proc in psutil.process_iter(["name"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["name"] or "").startswith("postgres"):
                out[proc.pid] = _cpu_s(proc.pid)
    return out


def _cpu_of(proc: psutil.Process | None) -> float:
    return _cpu_s(proc.pid) if proc is not None else 0.0


class CpuMeter:
    """CPU seconds of the target process, this process and PostgreSQL over one case (PostgreSQL's
    per process: backends come and go; one that ends during the case is missed)."""

    def __init__(self, postgres: bool, target: psutil.Process | None) -> None:
        self.postgres = postgres
        self.target = target

    def read(self) -> dict[str, Any]:
        from bench.procs import system_busy_s

        return {
            "trace": _cpu_of(self.target),
            "bench": _cpu_s(os.getpid()),
            "postgres": _postgres_cpu() if self.postgres else {},
            "machine": system_busy_s(),
            "wall": time.time(),
        }

    @staticmethod
    def report(before: dict[str, Any], after: dict[str, Any], n: int) -> dict[str, Any]:
        wall = after["wall"] - before["wall"]
        spent = {
            "trace": after["trace"] - before["trace"],
            "bench": after["bench"] - before["bench"],
            "postgres": sum(v - before["postgres"].get(pid, 0.0) for pid, v in after["postgres"].items()),
        }
        out: dict[str, Any] = {
            "machine_busy_cores": (after["machine"] - before["machine"]) / wall if wall else None
        }
        for key, seconds in spent.items():
            out[f"{key}_cores"] = seconds / wall if wall else None
            out[f"{key}_ms_per_append"] = 1000 * seconds / n if n else None
        return out


CHECK_SQL = """
SELECT s.id, s.last_sequence, s.head_sequence,
       (SELECT count(*) FROM messages m WHERE m.trace_id = s.id) AS n,
       (SELECT count(DISTINCT m.sequence) FROM messages m WHERE m.trace_id = s.id) AS distinct_n,
       (SELECT coalesce(max(m.sequence), 0) FROM messages m WHERE m.trace_id = s.id) AS max_seq,
       (SELECT count(*) FROM messages m WHERE m.trace_id = s.id AND m.sequence > 1
          AND m.parent_sequence IS DISTINCT FROM m.sequence - 1) AS off_chain
FROM traces s WHERE s.id = ANY($1::text[])
"""


def _problems(rows: list[tuple[Any, ...]], acked: dict[str, int], counter: bool) -> list[str]:
    found = {r[0]: r for r in rows}
    out = []
    for sid, n_acked in acked.items():
        r = found.get(sid)
        if r is None:
            out.append(f"{sid}: no session")
            continue
        _, last, head, n, distinct_n, max_seq, off_chain = r
        if n != n_acked or distinct_n != n or max_seq != n:
            out.append(f"{sid}: {n} rows ({distinct_n} distinct, max {max_seq}), {n_acked} acknowledged")
        if counter and (last != n or head != n or off_chain):
            out.append(f"{sid}: last {last}, head {head}, {off_chain} off the chain, {n} rows")
    return out


async def check_pg(url: str, acked: dict[str, int], counter: bool = True) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(CHECK_SQL, list(acked))
    finally:
        await conn.close()
    return _problems([tuple(r) for r in rows], acked, counter)


def check_sqlite(path: Path, acked: dict[str, int]) -> list[str]:
    sql = CHECK_SQL.replace("= ANY($1::text[])", f"IN ({','.join('?' * len(acked))})")
    with contextlib.closing(sqlite3.connect(path)) as conn:
        rows = conn.execute(sql, list(acked)).fetchall()
    return _problems(rows, acked, True)
