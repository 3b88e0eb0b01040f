"""The running bench: what each scenario does (its sizes), the model server's script for every
scenario, the targets and their processes, and the CPU readings the scenarios report."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench import clients
from bench.procs import Proc, own_cpu_s, system_busy_s
from bench.stats import user_text


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

    async def rpcs(self) -> dict[str, float]:
        """RPCs the mesh's gRPC services started so far, by service and method, the turns' own: the
        lease renewals and health checks every process makes on its own are left out."""
        out: dict[str, float] = {}
        async with httpx.AsyncClient(timeout=10) as http:
            for url in self.mesh.metrics.values():
                text = (await http.get(url)).text
                for family in text_string_to_metric_families(text):
                    if family.name != "agentmesh_grpc_server_started":
                        continue
                    for sample in family.samples:
                        if not sample.name.endswith("_total"):
                            continue
                        service, method = sample.labels["grpc_service"], sample.labels["grpc_method"]
                        if service.endswith("LeaseService") or method == "RenewStreams":
                            continue
                        name = f"{service.rsplit('.', 1)[-1]}.{method}"
                        out[name] = out.get(name, 0.0) + sample.value
        return out

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
