"""What `agentmesh up` does with its children: starts them, restarts one that dies (with backoff, logged)
while the others keep serving, and on stop drains callers before callees, each within the grace."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from agentmesh.libs.config import DRAIN_SETTLE_S

BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0)
HEALTHY_AFTER_S = 30.0  # a child that ran this long starts its backoff over


def _die_with_parent() -> None:
    """Linux: a child gets SIGTERM when `agentmesh up` itself dies, even by SIGKILL (no orphans)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    name: str
    cmd: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    failures: int = 0  # deaths in a row, for the backoff
    restart_at: float = 0.0  # when a dead child is due again (0: running)
    restarts: int = 0


@dataclass
class Supervisor:
    env: dict[str, str]
    grace_s: float
    log: Callable[[str], None] = field(default=logging.getLogger("agentmesh.supervisor").warning)
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    def add(self, name: str, cmd: list[str]) -> Child:
        child = Child(name, cmd)
        self.children.append(child)
        self._spawn(child)
        return child

    def _spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(
            child.cmd, env=self.env, start_new_session=True, preexec_fn=_die_with_parent
        )
        child.started_at = time.monotonic()
        child.restart_at = 0.0

    def poll(self) -> None:
        """Notices a child that died and restarts it when its backoff is over."""
        now = time.monotonic()
        for child in self.children:
            if self.stopping or child.proc is None:
                continue
            if child.restart_at:
                if now >= child.restart_at:
                    child.restarts += 1
                    self.log(f"restarting {child.name} (restart {child.restarts})")
                    self._spawn(child)
                continue
            code = child.proc.poll()
            if code is None:
                continue
            child.failures = 1 if now - child.started_at >= HEALTHY_AFTER_S else child.failures + 1
            delay = BACKOFF_S[min(child.failures, len(BACKOFF_S)) - 1]
            child.restart_at = now + delay
            self.log(f"{child.name} exited with {code}; restarting in {delay:g}s, the rest keeps serving")

    def stop(self) -> None:
        """Callers before callees (the reverse of the start order), each drained within the grace, so
        in-flight turns can still reach the services they write to."""
        self.stopping = True
        for child in reversed(self.children):
            proc = child.proc
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    # past the child's own drain (its grace, then DRAIN_SETTLE_S to settle what it
                    # cut short, then closing its clients): a child is killed only if it hangs
                    proc.wait(self.grace_s + DRAIN_SETTLE_S + 10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
