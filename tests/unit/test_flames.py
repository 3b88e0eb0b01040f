"""bench.flames reads py-spy's collapsed stacks: gRPC's poller thread, which py-spy counts as busy while
it waits, is left out of the shares and the flame graphs (docs/benchmarks.md, "Where the CPU goes")."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from bench import flames, profile
from bench.profile import top_frames

POLLER_WAIT = (
    "Thread._bootstrap (threading.py:1002);Thread._bootstrap_inner (threading.py:1045);"
    "Thread.run (threading.py:982) 40"
)
LOOP = "process 1:python;thread (0x7e);Runner.run (asyncio/runners.py:118);handle (svc/app.py:12) 9"
WORKER = (
    "Thread._bootstrap (threading.py:1002);Thread._bootstrap_inner (threading.py:1045);"
    "Thread.run (threading.py:982);work (svc/pool.py:7) 1"
)


def test_the_pollers_bare_stacks_are_left_out_and_a_thread_at_work_is_kept(tmp_path: Path) -> None:
    collapsed = tmp_path / "svc.txt"
    collapsed.write_text("\n".join([POLLER_WAIT, LOOP, WORKER, "not a stack"]) + "\n")
    stacks = list(flames.stacks(collapsed))
    assert [(frames[-1].partition(" (")[0], n) for frames, n in stacks] == [("handle", 9), ("work", 1)]
    assert flames.tree(collapsed).samples == 10
    shares = top_frames(collapsed)
    assert shares["samples"] == 10
    assert shares["self_pct"][0] == ("handle (svc/app.py)", 90.0)


def test_a_thread_that_ended_between_readings_still_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.profile's threads beside the event loop: from the process's CPU, which keeps what ended
    threads spent (its live threads' times do not), so a share is never lost or negative."""
    monkeypatch.setattr(profile, "_label", lambda cmdline: "svc")
    mesh = SimpleNamespace(processes=lambda: [psutil.Process()])

    def burn() -> None:  # /proc counts CPU in 10 ms ticks: twice the margin the assertion needs
        while time.thread_time() < 0.1:
            pass

    before = profile.thread_cpu(mesh)  # type: ignore[arg-type]
    worker = threading.Thread(target=burn)
    worker.start()
    worker.join()
    after = profile.thread_cpu(mesh)  # type: ignore[arg-type]
    assert after["svc"][1] - before["svc"][1] >= 0.04
    assert profile.thread_shares(before, after)["svc"] > 0
