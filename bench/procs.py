"""The processes under test, started through their public commands, and the CPU they burn.

- the scripted model server: `agentmesh mock-llm --port P --rules FILE --ttft-ms 0 --tokens-per-second 0`
  (every scenario's pace comes from its rule), its own process, shared by every target;
- the mesh: `agentmesh up --no-mock-llm` with `AGENTMESH_LLM__BASE_URL` pointed at that model server,
  so the process tree of `agentmesh up` is the mesh and nothing else (gateway, orchestrator,
  agent-runtime, trace on SQLite, stream in memory, and `up` itself, which only supervises);
- the LangGraph peer: `langgraph dev --no-browser --no-reload` from its own virtual environment,
  in a scratch copy of bench/peers/langgraph, with ChatOpenAI pointed at the same model server.

CPU is read with psutil (user + system seconds) over each process tree, before and after a phase.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from tests.mesh import Ports, process_env

HERE = Path(__file__).resolve().parent
PEERS = HERE / "peers"

# Outbound calls `langgraph dev` would make, switched off (the bench runs offline, on loopback only):
# CLI analytics, the PyPI version check, LangSmith tracing. The metadata beacon only runs with a
# license key, which is not set; --no-browser skips the Studio organisation look-up.
LANGGRAPH_OFFLINE_ENV = {
    "LANGGRAPH_CLI_NO_ANALYTICS": "1",
    "LANGGRAPH_NO_VERSION_CHECK": "true",
    "LANGSMITH_TRACING": "false",
    "LANGCHAIN_TRACING_V2": "false",
    "LANGSMITH_API_KEY": "",
    "LOG_LEVEL": "WARNING",
}


# Ports the bench's processes serve on, held (SO_REUSEADDR, never listened on) for the whole run so
# no other program takes one between the choice and the bind (see tests.mesh.Ports).
PORTS = Ports()


def free_port() -> int:
    return PORTS.take()


def unreserved_port() -> int:
    """A port free right now, not held: for a server that checks the port itself and moves to
    another one when it finds it bound (`langgraph dev` does), which a reserved port would be."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def mesh_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """Environment for `agentmesh up` on reserved loopback ports."""
    return process_env(data_dir, PORTS, **extra)


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by every process started here): 1,000
    streams hold thousands of sockets across the model server, the mesh and the load generator."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


@dataclass
class Proc:
    """A started command in its own process group, its output in a log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    urls: list[str] = field(default_factory=list)  # every gateway's URL when there are several
    extra: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, str] = field(default_factory=dict)  # service -> its /metrics URL (the mesh)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def processes(self) -> list[psutil.Process]:
        """The process and its descendants (an empty list once it is gone)."""
        try:
            root = psutil.Process(self.popen.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def cpu(self) -> dict[str, float]:
        """CPU seconds (user + system) of each process of the tree, by process label."""
        out: dict[str, float] = {}
        for proc in self.processes():
            try:
                t = proc.cpu_times()
                label = _label(proc.cmdline()) or self.name
            except psutil.Error:
                continue
            out[label] = out.get(label, 0.0) + t.user + t.system
        return out

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)


def _label(cmdline: list[str]) -> str:
    """`... agentmesh.cli serve gateway` -> gateway; `... agentmesh.cli up` -> up."""
    if "serve" in cmdline:
        i = cmdline.index("serve")
        if i + 1 < len(cmdline):
            return cmdline[i + 1]
    if "up" in cmdline and any("agentmesh" in part for part in cmdline):
        return "up"
    return ""


def _spawn(name: str, cmd: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> Proc:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        popen = subprocess.Popen(
            cmd,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Proc(name=name, popen=popen, log=log)


def _wait_http(proc: Proc, url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code < 500:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name}: {url} did not answer within {timeout_s}s:\n{proc.tail()}")


def start_mock(work: Path, rules: Path) -> Proc:
    port = free_port()
    env = dict(os.environ, AGENTMESH_LOG_LEVEL="WARNING")
    cmd = [sys.executable, "-m", "agentmesh.cli", "mock-llm", "--port", str(port), "--rules", str(rules)]
    cmd += ["--ttft-ms", "0", "--tokens-per-second", "0"]
    proc = _spawn("mock-llm", cmd, env, work / "mock-llm.log")
    proc.url = f"http://127.0.0.1:{port}"
    _wait_http(proc, f"{proc.url}/v1/models", 60)
    return proc


METRICS_SERVICES = ("orchestrator", "agent-runtime", "trace", "stream")


def start_mesh(
    work: Path, mock_url: str, catalog: Path, log_level: str = "WARNING", root: Path | None = None
) -> Proc:
    """`agentmesh up --no-mock-llm` on free ports with a fresh SQLite file; waits for the dev key.
    `root`: another checkout of the mesh, set up with `make setup`, to run instead of this one, for a
    before/after comparison in one run. Its own interpreter runs it: this one's editable install maps
    `agentmesh.services`, `.gateway` and `.libs` to this checkout, whatever the working directory."""
    data = work / "mesh"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    env = mesh_env(
        data,
        AGENTMESH_LOG_LEVEL=log_level,
        AGENTMESH_LOG_JSON="true",
        # Scenario F's remote callee is this mesh itself over A2A, with the development key.
        AGENTMESH_BENCH_A2A_KEY_FILE=str(data / "dev_api_key"),
        AGENTMESH_LLM__BASE_URL=f"{mock_url}/v1",
        AGENTMESH_LLM__API_KEY="bench",
        AGENTMESH_LLM__REQUEST_TIMEOUT_S="300",
    )
    # Each gRPC service's /metrics, where the bench counts a turn's RPCs (RpcMetrics).
    metrics = {service: f"127.0.0.1:{free_port()}" for service in METRICS_SERVICES}
    for service, address in metrics.items():
        env[f"AGENTMESH_METRICS__{service.upper().replace('-', '_')}"] = address
    python = sys.executable
    if root is not None:
        python = str(root / ".venv" / "bin" / "python")
        if not Path(python).exists():
            raise RuntimeError(f"{root} has no .venv: run `make setup` there first")
    text = catalog.read_text()  # a remote agent of the catalog names this mesh's gateway port
    rendered = work / "catalog.yaml"
    rendered.write_text(text.replace("{gateway_port}", env["AGENTMESH_GATEWAY_PORT"]))
    env["AGENTMESH_CATALOG"] = str(rendered)
    cmd = [python, "-m", "agentmesh.cli", "up", "--no-mock-llm"]
    proc = _spawn("mesh", cmd, env, work / "mesh.log", cwd=root)
    proc.url = f"http://127.0.0.1:{env['AGENTMESH_GATEWAY_PORT']}"
    proc.metrics = {service: f"http://{address}/metrics" for service, address in metrics.items()}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"agentmesh up exited with {proc.popen.returncode}:\n{proc.tail()}")
        for line in proc.log.read_text(errors="replace").splitlines():
            if "development API key" in line:
                proc.extra["key"] = line.rsplit(":", 1)[1].strip()
                return proc
        time.sleep(0.2)
    raise RuntimeError(f"agentmesh up did not print its key within 120s:\n{proc.tail()}")


def peers_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def start_langgraph(work: Path, venv: Path, mock_url: str, jobs: int) -> Proc:
    """`langgraph dev` from `venv` on a free port, running bench/peers/langgraph/graph.py.

    --n-jobs-per-worker: `langgraph dev` runs ONE run at a time unless told otherwise (its run queue
    gets N_JOBS_PER_WORKER=1 when the flag is absent, although --help says 10); the bench gives it
    as many as the largest N so that the peer serves every session at once, as the mesh does.
    --allow-blocking: switches off blockbuster, the dev server's detector of blocking calls, which
    wraps I/O functions and is not part of a production deployment.
    """
    venv = venv.resolve()  # it runs in a scratch directory
    exe = venv / "bin" / "langgraph"
    if not exe.exists():
        raise RuntimeError(f"{exe} is missing: run `make bench-peers` (it creates {venv})")
    app = work / "langgraph"
    shutil.rmtree(app, ignore_errors=True)
    app.mkdir(parents=True)
    for name in ("graph.py", "langgraph.json"):
        shutil.copy(PEERS / "langgraph" / name, app / name)
    port = unreserved_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTMESH_", "VIRTUAL_ENV"))}
    env.update(LANGGRAPH_OFFLINE_ENV, OPENAI_BASE_URL=f"{mock_url}/v1", OPENAI_API_KEY="bench")
    cmd = [str(exe), "dev", "--no-browser", "--no-reload", "--allow-blocking", "--port", str(port)]
    cmd += ["--n-jobs-per-worker", str(jobs), "--server-log-level", "WARNING"]
    proc = _spawn("langgraph", cmd, env, work / "langgraph.log", cwd=app)
    proc.url = f"http://127.0.0.1:{port}"
    _wait_http(proc, f"{proc.url}/ok", 120)
    return proc


def running_threads(pids: list[int]) -> int:
    """Threads of these processes on a core or waiting for one right now (state R in /proc)."""
    count = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            end = stat.rfind(b")")  # the command name may hold spaces and parentheses
            if stat[end + 2 : end + 3] == b"R":
                count += 1
    return count


def system_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all processes, all cores) since boot."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def own_cpu_s() -> float:
    """CPU seconds of this process (the harness; the load generator when it runs in-process)."""
    t = psutil.Process().cpu_times()
    return float(t.user + t.system)
