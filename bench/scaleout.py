"""Scenario S (scale-out): scenario C's sessions against a mesh of replicas on PostgreSQL and Redis,
beside the same mesh with one replica of each, in one run (`python -m bench.run --scenarios S`).

Each mesh is started here process by process (`agentmesh serve SERVICE`), as Kubernetes runs it: one
trace service, and R replicas each of gateway, orchestrator and agent-runtime (--scale-services; stream
may be one, on its Redis backend it always is), every replica on its own loopback port. The callers of
a replicated service dial all of its replicas (`ipv4:127.0.0.1:P1,127.0.0.1:P2` in
AGENTMESH_ADDRESSES__*, round robin, see libs/rpc.py), and the load generator spreads the sessions
over the gateways in turn. Each mesh gets a fresh PostgreSQL database (created next to the admin
URL's, dropped at the end) and a key prefix of its own in Redis (its keys deleted at the end).

Reported per mesh and N: the sessions' figures as in C, CPU seconds per 1k tokens by process kind
(summed over replicas), the busiest process and its CPU, and how evenly each replicated gRPC service's
replicas were called (RPCs started, from each process's /metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench import procs
from bench.databases import create_database, drop_database
from bench.harness import Bench
from bench.loadgen import LoadGenerator
from bench.procs import Proc
from bench.scenarios.concurrent import _c_phase, load_procs_for
from bench.tables import errors, get, num, skipped, table

DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
SERVICES = ("trace", "stream", "agent-runtime", "orchestrator", "gateway")  # callees first
REPLICATED = ("gateway", "orchestrator", "agent-runtime")  # the default of --scale-services
KINDS = ("gateway", "orchestrator", "agent-runtime", "stream", "trace")


@dataclass
class Replicas(Proc):
    """A mesh of single-service processes, seen by the harness as one target: its CPU is read by
    process name (`gateway-2`), its RPCs from every gRPC process's /metrics."""

    members: dict[str, Proc] = field(default_factory=dict)

    def alive(self) -> bool:
        return all(m.alive() for m in self.members.values())

    def tail(self, lines: int = 20) -> str:
        return "\n".join(f"[{name}] {m.tail(lines)}" for name, m in self.members.items() if not m.alive())

    def processes(self) -> list[Any]:
        return [p for m in self.members.values() for p in m.processes()]

    def cpu(self) -> dict[str, float]:
        return {name: sum(m.cpu().values()) for name, m in self.members.items()}

    def stop(self, grace_s: float = 20.0) -> None:
        for name in reversed(list(self.members)):  # callers first
            self.members[name].stop(grace_s)


def kind_of(name: str) -> str:
    """`agent-runtime-2` -> agent-runtime."""
    head, _, tail = name.rpartition("-")
    return head if tail.isdigit() and head else name


async def _wait_grpc(proc: Proc, target: str) -> None:
    from agentmesh.libs.rpc import wait_serving

    try:
        await wait_serving(target, timeout_s=60)
    except (TimeoutError, RuntimeError) as exc:
        raise RuntimeError(f"{proc.name} is not serving at {target}: {exc}\n{proc.tail()}") from exc


async def _wait_http(proc: Proc, url: str, timeout_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient(timeout=2) as http:
        while loop.time() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if (await http.get(url)).status_code < 500:
                    return
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{proc.name}: {url} did not answer within {timeout_s}s:\n{proc.tail()}")


async def start(
    work: Path,
    mock_url: str,
    catalog: Path,
    database_url: str,
    redis_url: str,
    replicas: int,
    log_level: str,
    replicated: tuple[str, ...] = REPLICATED,
) -> Replicas:
    """The mesh with `replicas` of each service in `replicated` (one of the others), on `database_url`
    and `redis_url`."""
    data = work / f"mesh-x{replicas}"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    secret = secrets.token_hex(32)
    prefix = f"agentmesh-bench-{uuid.uuid4().hex[:8]}:"
    env = procs.mesh_env(
        data,
        AGENTMESH_LOG_LEVEL=log_level,
        AGENTMESH_LOG_JSON="true",
        AGENTMESH_MESH_SECRET=secret,
        AGENTMESH_DATABASE_URL=database_url,
        AGENTMESH_REDIS_URL=redis_url,
        AGENTMESH_STREAM__BACKEND="redis",
        AGENTMESH_STREAM__REDIS_PREFIX=prefix,
        AGENTMESH_LLM__BASE_URL=f"{mock_url}/v1",
        AGENTMESH_LLM__API_KEY="bench",
        AGENTMESH_LLM__REQUEST_TIMEOUT_S="300",
    )
    rendered = data / "catalog.yaml"
    text = await asyncio.to_thread(catalog.read_text)
    rendered.write_text(text.replace("{gateway_port}", env["AGENTMESH_GATEWAY_PORT"]))
    env["AGENTMESH_CATALOG"] = str(rendered)
    own: dict[str, tuple[str, dict[str, str]]] = {}  # process name -> (service, its own environment)
    for service in SERVICES:
        count = replicas if service in replicated else 1
        names = [service] if count == 1 else [f"{service}-{i + 1}" for i in range(count)]
        if service == "gateway":
            for i, name in enumerate(names):
                port = env["AGENTMESH_GATEWAY_PORT"] if i == 0 else str(procs.free_port())
                a2a = env["AGENTMESH_A2A__GRPC_LISTEN"] if i == 0 else f"127.0.0.1:{procs.free_port()}"
                own[name] = (service, {"AGENTMESH_GATEWAY_PORT": port, "AGENTMESH_A2A__GRPC_LISTEN": a2a})
            continue
        key = service.upper().replace("-", "_")
        listen = [env[f"AGENTMESH_ADDRESSES__{key}"]]
        if count > 1:
            listen = [f"127.0.0.1:{procs.free_port()}" for _ in names]
            env[f"AGENTMESH_ADDRESSES__{key}"] = "ipv4:" + ",".join(listen)
        for name, address in zip(names, listen, strict=True):
            own[name] = (
                service,
                {
                    f"AGENTMESH_LISTEN__{key}": address,
                    f"AGENTMESH_METRICS__{key}": f"127.0.0.1:{procs.free_port()}",
                },
            )
    members: dict[str, Proc] = {}
    mesh: Replicas | None = None
    try:
        for service in SERVICES:
            waits = []
            for name, (svc, extra) in own.items():
                if svc != service:
                    continue
                cmd = [sys.executable, "-m", "agentmesh.cli", "serve", service]
                proc = procs._spawn(name, cmd, {**env, **extra}, data / f"{name}.log")
                members[name] = proc
                if service == "gateway":
                    proc.url = f"http://127.0.0.1:{extra['AGENTMESH_GATEWAY_PORT']}"
                    waits.append(_wait_http(proc, f"{proc.url}/healthz"))
                else:
                    key = service.upper().replace("-", "_")
                    proc.metrics = {name: f"http://{extra[f'AGENTMESH_METRICS__{key}']}/metrics"}
                    waits.append(_wait_grpc(proc, extra[f"AGENTMESH_LISTEN__{key}"]))
            await asyncio.gather(*waits)
        first = next(iter(members.values()))
        gateways = [m.url for m in members.values() if m.url]
        mesh = Replicas(name=f"mesh-x{replicas}", popen=first.popen, log=first.log, members=members)
        mesh.url, mesh.urls = gateways[0], gateways
        mesh.metrics = {k: v for m in members.values() for k, v in m.metrics.items()}
        mesh.extra.update(prefix=prefix, key=await _api_key(env))
        return mesh
    except BaseException:
        for proc in reversed(list(members.values())):
            proc.stop(5)
        raise


async def _api_key(env: dict[str, str]) -> str:
    """A key of user `bench`, created as `agentmesh up` creates its development key."""
    from agentmesh.cli.common import create_key
    from agentmesh.libs.config import MeshSettings

    saved = dict(os.environ)
    os.environ.update({k: v for k, v in env.items() if k.startswith("AGENTMESH_")})
    try:
        settings = MeshSettings()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return await create_key(settings, "bench")


async def rpcs_by_process(mesh: Replicas) -> dict[str, float]:
    """RPCs each gRPC process served so far (lease renewals and health checks left out)."""
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=10) as http:
        for name, url in mesh.metrics.items():
            total = 0.0
            for family in text_string_to_metric_families((await http.get(url)).text):
                if family.name != "agentmesh_grpc_server_started":
                    continue
                for sample in family.samples:
                    service, method = sample.labels.get("grpc_service", ""), sample.labels.get("grpc_method")
                    if not sample.name.endswith("_total") or service.endswith(("LeaseService", "Health")):
                        continue
                    if method != "RenewStreams":
                        total += sample.value
            out[name] = total
    return out


STORES = {"redis-server": "redis", "postgres": "postgres"}  # process name -> how the report calls it


def _store_cpu() -> dict[str, float]:
    """CPU seconds so far of the Redis and PostgreSQL servers on this machine (every process of each;
    they may serve other clients too)."""
    out = dict.fromkeys(STORES.values(), 0.0)
    for proc in psutil.process_iter(["name", "cpu_times"]):
        label = STORES.get(proc.info["name"] or "")
        if label and proc.info["cpu_times"] is not None:
            out[label] += proc.info["cpu_times"].user + proc.info["cpu_times"].system
    return out


async def sample_peaks(mesh: Replicas, peaks: dict[str, float], interval_s: float = 1.0) -> None:
    """Until cancelled: each process's (and the stores') busiest `interval_s` in cores, into `peaks`.
    A phase's average hides a process that ran at a whole core while the sessions streamed."""
    last, t0 = {**mesh.cpu(), **_store_cpu()}, time.monotonic()
    while True:
        await asyncio.sleep(interval_s)
        now, t1 = {**mesh.cpu(), **_store_cpu()}, time.monotonic()
        for name, value in now.items():
            cores = (value - last.get(name, value)) / (t1 - t0)
            peaks[name] = max(peaks.get(name, 0.0), cores)
        last, t0 = now, t1


async def drop_keys(redis_url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    try:
        keys = [k async for k in client.scan_iter(match=f"{prefix}*", count=1000)]
        for i in range(0, len(keys), 500):
            await client.delete(*keys[i : i + 500])
    finally:
        await client.aclose()


def summarise(phase: dict[str, Any], before: dict[str, float], after: dict[str, float]) -> None:
    """Adds to a phase: CPU by process kind, the busiest process, and each replica's RPCs."""
    wall = get(phase, "cpu", "wall_s") or 0.0
    per_1k = get(phase, "cpu", "mesh", "by_process_per_1k_tokens_s") or {}
    tokens = phase.get("tokens") or 0
    cpu_s = {name: v * tokens / 1000 for name, v in per_1k.items()}
    by_kind: dict[str, float] = {}
    for name, v in per_1k.items():
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + v
    phase["per_1k_tokens_by_kind_s"] = by_kind
    phase["cores_by_process"] = {name: v / wall for name, v in cpu_s.items()} if wall else {}
    if cpu_s:
        busiest = max(cpu_s, key=lambda k: cpu_s[k])
        total = sum(cpu_s.values())
        phase["busiest"] = {
            "process": busiest,
            "cores": cpu_s[busiest] / wall if wall else None,
            "share_of_mesh_cpu": cpu_s[busiest] / total if total else None,
        }
    phase["rpcs_by_process"] = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


async def scenario_s(bench: Bench, args: Any, work: Path, catalog: Path) -> dict[str, Any]:
    """S: C's phases on the PostgreSQL + Redis mesh with one replica of each, then with two."""
    z = bench.sizes
    admin = args.e_database_url or os.environ.get("TEST_DATABASE_URL") or DEFAULT_PG
    admin = admin.replace("postgresql+asyncpg://", "postgresql://")
    redis_url = os.environ.get("TEST_REDIS_URL") or DEFAULT_REDIS
    replicated = tuple(x.strip() for x in args.scale_services.split(",") if x.strip())
    if set(replicated) - set(SERVICES) or "trace" in replicated:
        raise ValueError(
            f"--scale-services: a subset of gateway,orchestrator,agent-runtime,stream: {replicated}"
        )
    result: dict[str, Any] = {
        "what": (
            f"scenario C ({z.c_tokens} tokens each at {z.c_tps:g} tokens/s, starts spread over "
            f"{z.c_spread_s:g} s) on PostgreSQL + Redis: one replica of each service, then "
            f"{args.scale_replicas} each of {', '.join(replicated)} (one of the others)"
        ),
        "phases": [],
        "logs": {},
    }
    gen = await asyncio.to_thread(
        LoadGenerator, max(load_procs_for(bench.load_procs, n) for n in z.c_sessions)
    )
    try:
        for replicas in (1, args.scale_replicas):
            database = await create_database(admin, "bench")
            mesh: Replicas | None = None
            try:
                mesh = await start(
                    work,
                    bench.mock.url,
                    catalog,
                    database,
                    redis_url,
                    replicas,
                    args.mesh_log_level,
                    replicated,
                )
                run = Bench(sizes=z, mock=bench.mock, mesh=mesh, peers={}, load_procs=bench.load_procs)
                for n in z.c_sessions:
                    gen.procs = load_procs_for(bench.load_procs, n)
                    print(f"  S N={n} replicas={replicas} ...", flush=True)
                    before = await rpcs_by_process(mesh)
                    peaks: dict[str, float] = {}
                    sampler = asyncio.create_task(sample_peaks(mesh, peaks))
                    try:
                        phase = await _c_phase(run, gen, "mesh", n)
                    finally:
                        sampler.cancel()
                    summarise(phase, before, await rpcs_by_process(mesh))
                    phase["peak_cores_1s"] = peaks
                    phase["replicas"] = replicas
                    result["phases"].append(phase)
                    print("   ", _line(phase), flush=True)
            finally:
                if mesh is not None:
                    from bench.run import log_findings

                    for name, member in mesh.members.items():
                        result["logs"][f"x{replicas} {name}"] = log_findings(member)
                    await asyncio.to_thread(mesh.stop)
                    with contextlib.suppress(Exception):
                        await drop_keys(redis_url, mesh.extra["prefix"])
                await drop_database(admin, database)
    finally:
        gen.close()
    return result


def _line(p: dict[str, Any]) -> str:
    b = p.get("busiest") or {}
    return (
        f"ok {p['ok']}/{p['n']} errors {p['errors'] or '-'}"
        f" first p50 {get(p, 'first_delta_ms', 'p50') or 0:.0f} ms"
        f" gap-pace p99 {get(p, 'gap_minus_pace_ms', 'p99') or 0:.1f} ms"
        f" busiest {b.get('process')} {b.get('cores') or 0:.2f} cores"
        f" machine {get(p, 'cpu', 'machine_busy_cores') or 0:.2f} cores"
    )


def _balance(p: dict[str, Any]) -> str:
    """Each replicated gRPC service's RPCs split over its replicas, e.g. `orchestrator 50/50`."""
    rpcs = p.get("rpcs_by_process") or {}
    parts = []
    for kind in ("orchestrator", "agent-runtime", "stream"):
        counts = [v for name, v in sorted(rpcs.items()) if kind_of(name) == kind and name != kind]
        total = sum(counts)
        if len(counts) > 1 and total:
            parts.append(f"{kind} " + "/".join(f"{100 * c / total:.0f}" for c in counts))
    return ", ".join(parts) or "-"


def markdown(s: dict[str, Any]) -> list[str]:
    out = [f"## S (scale-out): {s.get('what', '')}", "", *skipped(s)]
    phases = s.get("phases") or []
    if not phases:
        return out
    rows = []
    for p in phases:
        by = p.get("per_1k_tokens_by_kind_s") or {}
        b = p.get("busiest") or {}
        rows.append(
            [
                str(p["n"]),
                str(p["replicas"]),
                f"{p['ok']}/{p['n']}",
                errors(p["errors"]),
                num(get(p, "first_delta_ms", "p50")),
                num(get(p, "first_delta_ms", "p99")),
                num(get(p, "gap_minus_pace_ms", "p99")),
                *(num(by.get(k), 3) for k in KINDS),
                num(get(p, "cpu", "mesh", "per_1k_tokens_s"), 3),
                f"{b.get('process', '-')} {num(b.get('cores'), 2)} cores "
                f"({num(100 * (b.get('share_of_mesh_cpu') or 0), 0)}% of the mesh's)",
                num(get(p, "cpu", "machine_busy_cores"), 2),
                _balance(p),
            ]
        )
    head = ["N", "replicas", "ok", "errors", "first delta p50 ms", "p99", "gap - pace p99 ms",
            *(f"{k} CPU s / 1k tok" for k in KINDS), "mesh CPU s / 1k tok",
            "busiest process (cores over the phase, share of the mesh's CPU)", "machine busy cores",
            "RPC split over replicas %"]  # fmt: skip
    out += [*table(head, rows), ""]
    out += [
        "Each process's busiest second of the phase, in cores (the replicated kinds: their busiest "
        "replica), and the Redis and PostgreSQL servers' (all their processes, whoever they served):",
        "",
    ]
    peak_rows = []
    for p in phases:
        peaks = p.get("peak_cores_1s") or {}
        by_kind: dict[str, float] = {}
        for name, cores in peaks.items():
            by_kind[kind_of(name)] = max(by_kind.get(kind_of(name), 0.0), cores)
        peak_rows.append(
            [str(p["n"]), str(p["replicas"]), *(num(by_kind.get(k), 2) for k in (*KINDS, *STORES.values()))]
        )
    out += table(["N", "replicas", *KINDS, *STORES.values()], peak_rows)
    return [*out, ""]
