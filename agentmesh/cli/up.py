"""`agentmesh up`: the whole mesh on loopback, supervised, with the bundled model server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import httpx

from agentmesh.cli.common import create_key, dev_key_file, key_works
from agentmesh.cli.serve import SERVICES
from agentmesh.libs.config import load_settings
from agentmesh.libs.files import private_dir, write_private

if TYPE_CHECKING:
    from agentmesh.supervisor import Supervisor


def _port_base(value: str) -> int:
    from agentmesh.ports import SPAN

    base = int(value)
    if not 1 <= base <= 65536 - SPAN:
        raise argparse.ArgumentTypeError(
            f"give a port from 1 to {65536 - SPAN} (the mesh takes {SPAN} from it)"
        )
    return base


def _positive(value: str) -> float:
    number = float(value)
    if number < 0:
        raise argparse.ArgumentTypeError("give a number of tokens per second, 0 or more")
    return number


def add_parser(sub: Any) -> None:
    up = sub.add_parser(
        "up",
        help="start the whole mesh on loopback",
        description="Start the bundled model server, the four services and the gateway on loopback, "
        "supervised. Every port is checked first; a busy one stops `up` with exit 1.",
    )
    up.add_argument(
        "--port-base",
        type=_port_base,
        metavar="N",
        help="move the whole mesh: the gateway on N, orchestrator, agent-runtime, trace and stream on N+1 "
        "to N+4, A2A gRPC on N+5, the bundled model on N+6, metrics (when configured) on N+7 to N+11; "
        "default: the settings (8080, 50051-50055) and 8090",
    )
    up.add_argument(
        "--mock-port",
        type=int,
        default=None,
        metavar="PORT",
        help="the bundled model server's port (default 8090, or N+6 with --port-base)",
    )
    up.add_argument(
        "--tokens-per-second",
        type=_positive,
        metavar="N",
        help="the bundled model's streaming pace (default: its rules file's, 200; 0: as fast as it can)",
    )
    model = up.add_mutually_exclusive_group()
    model.add_argument(
        "--model-url",
        metavar="URL",
        help="an OpenAI-compatible endpoint (e.g. https://api.openai.com/v1) instead of the bundled model; "
        "its key comes from AGENTMESH_LLM__API_KEY",
    )
    model.add_argument(
        "--no-mock-llm",
        action="store_true",
        help="do not start the bundled model: use AGENTMESH_LLM__BASE_URL",
    )


def run(args: argparse.Namespace) -> int:
    """Checks every port it will use, then starts the model server (unless another model is named),
    the four services and the gateway as processes on loopback, and supervises them: a child that
    dies is restarted (with backoff) while the rest keeps serving."""
    from agentmesh import ports
    from agentmesh.libs.identity import load_secret
    from agentmesh.libs.log import setup_logging
    from agentmesh.supervisor import Supervisor

    bundled = not (args.no_mock_llm or args.model_url)
    if args.port_base is not None:
        os.environ.update(ports.based_env(args.port_base, load_settings()))
    mock_port = args.mock_port
    if mock_port is None:
        mock_port = 8090 if args.port_base is None else args.port_base + ports.OFFSETS["model"]
    if args.model_url:
        os.environ["AGENTMESH_LLM__BASE_URL"] = args.model_url
    elif bundled:
        os.environ.setdefault("AGENTMESH_LLM__BASE_URL", f"http://127.0.0.1:{mock_port}/v1")
    settings = load_settings()
    problems = ports.problems(ports.planned(settings, mock_port if bundled else None))
    if problems:
        base = ports.free_base()
        print(f"agentmesh up: {'; '.join(problems)}", file=sys.stderr)
        move = f"agentmesh up --port-base {base}" if base else "agentmesh up --port-base N"
        print(f"  another mesh may be running: stop it, or start this one on other ports: {move}",
              file=sys.stderr)  # fmt: skip
        return 1
    private_dir(settings.data_dir)
    load_secret(settings.mesh_secret, settings.data_dir)  # every child reads the same mesh secret
    # The children write to this stderr: JSON lines, or text when it is a terminal (libs/log.py).
    setup_logging("up", settings.log_level, settings.log_json)
    supervisor = Supervisor(dict(os.environ), settings.shutdown_grace_s)
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    py = sys.executable
    try:
        if bundled:
            pace = (
                [] if args.tokens_per_second is None else ["--tokens-per-second", str(args.tokens_per_second)]
            )
            supervisor.add(
                "mock-llm", [py, "-m", "agentmesh.cli", "mock-llm", "--port", str(mock_port), *pace]
            )
        from agentmesh.libs.rpc import wait_serving

        a = settings.addresses
        # The stores first: a process whose first calls (the orchestrator's reaper, the gateway's
        # lease keeper) find a store not yet listening leaves that channel in reconnect backoff for up
        # to a second, and a turn in that second would fail UNAVAILABLE although everything is up.
        for wave, targets in (
            (SERVICES[:2], (a.trace, a.stream)),
            (SERVICES[2:], (a.agent_runtime, a.orchestrator)),
        ):
            for name in wave:
                supervisor.add(name, [py, "-m", "agentmesh.cli", "serve", name])
            for target in targets:
                asyncio.run(wait_serving(target, timeout_s=60))
        url = f"http://{settings.gateway_host}:{settings.gateway_port}"
        _wait_http(f"{url}/healthz", 60, supervisor)
        if bundled:
            _wait_http(f"http://127.0.0.1:{mock_port}/v1/models", 60, supervisor)
        key_file = dev_key_file(settings)
        key = key_file.read_text().strip() if key_file.exists() else ""
        if not key or not asyncio.run(key_works(settings, key)):
            key = asyncio.run(create_key(settings, "dev"))
            write_private(key_file, key + "\n")
        print(f"\nagentmesh is up at {url}\n  development API key (user dev): {key}\n", flush=True)
        if bundled:
            speed = f", {args.tokens_per_second:g} tokens/s" if args.tokens_per_second is not None else ""
            print(f"  model: the bundled scripted model at {settings.llm.base_url}{speed}", flush=True)
        else:
            print(f"  model: {settings.llm.base_url}", flush=True)
        print(
            f'  try: curl -N -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\',
            flush=True,
        )
        print(f'        -d \'{{"agent": "general", "message": "hello"}}\' {url}/api/chat\n', flush=True)
        a2a_grpc = f", gRPC at {settings.a2a.grpc_listen}" if settings.a2a.grpc_listen else ""
        print(f"  A2A: agent cards at {url}/a2a/<slug>/.well-known/agent-card.json{a2a_grpc}\n", flush=True)
        print("  Ctrl-C stops everything.", flush=True)
        while not stop:
            supervisor.poll()
            time.sleep(0.2)
    except (TimeoutError, RuntimeError) as exc:
        print(f"agentmesh up: {exc}", file=sys.stderr)
        return 1
    finally:
        supervisor.stop()
    return 0


def _wait_http(url: str, timeout_s: float, supervisor: Supervisor) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in supervisor.children:
            if child.proc is not None and child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s")
