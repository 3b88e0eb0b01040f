"""The `agentmesh` command: up, serve SERVICE, health ADDRESS, chat, agents, keys create, mock-llm."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from agentmesh import agents_cli
from agentmesh.libs.config import MeshSettings, load_settings
from agentmesh.libs.transport import use_classic_transport

if TYPE_CHECKING:
    from agentmesh.supervisor import Supervisor

SERVICES = ("trace", "stream", "agent-runtime", "orchestrator", "gateway")


def _serve(name: str) -> int:
    settings = load_settings()
    if name == "trace":
        from agentmesh.services.trace.server import main as run
    elif name == "stream":
        from agentmesh.services.stream.server import main as run
    elif name == "agent-runtime":
        from agentmesh.services.agent_runtime.server import main as run
    elif name == "orchestrator":
        from agentmesh.services.orchestrator.server import main as run
    elif name == "gateway":
        from agentmesh.gateway.server import main as run
    else:
        print(f"unknown service {name!r}; one of {', '.join(SERVICES)}", file=sys.stderr)
        return 2
    from agentmesh.libs import telemetry
    from agentmesh.libs.log import setup_logging

    setup_logging(name, settings.log_level, settings.log_json)
    telemetry.setup(name)  # only with OTEL_EXPORTER_OTLP_ENDPOINT
    from agentmesh.libs.aio import run as run_loop

    try:
        run_loop(run(settings))
    finally:
        telemetry.shutdown()
    return 0


async def _create_key(settings: MeshSettings, user: str) -> str:
    from agentmesh.auth.v1 import auth_service_pb2 as au
    from agentmesh.libs.clients import Clients

    clients = Clients(settings)
    try:
        resp = await clients.auth.CreateApiKey(au.CreateApiKeyRequest(user=user))
        return resp.api_key
    finally:
        await clients.close()


async def _key_works(settings: MeshSettings, key: str) -> bool:
    from agentmesh.auth.v1 import auth_service_pb2 as au
    from agentmesh.libs.clients import Clients

    clients = Clients(settings)
    try:
        await clients.auth.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key=key))
        return True
    except Exception:
        return False
    finally:
        await clients.close()


def _dev_key_file(settings: MeshSettings) -> Path:
    return settings.data_dir / "dev_api_key"


def _up(args: argparse.Namespace) -> int:
    """Starts the mock model, the four services and the gateway as processes on loopback, and
    supervises them: a child that dies is restarted (with backoff) while the rest keeps serving."""
    from agentmesh.libs.identity import load_secret
    from agentmesh.supervisor import Supervisor

    settings = load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    load_secret(settings.mesh_secret, settings.data_dir)  # every child reads the same mesh secret
    env = dict(os.environ)
    env.setdefault("AGENTMESH_LOG_JSON", "false")
    mock_port = args.mock_port
    if not args.no_mock_llm:
        env.setdefault("AGENTMESH_LLM__BASE_URL", f"http://127.0.0.1:{mock_port}/v1")
    supervisor = Supervisor(env, settings.shutdown_grace_s)
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    py = sys.executable
    try:
        if not args.no_mock_llm:
            supervisor.add("mock-llm", [py, "-m", "agentmesh.cli", "mock-llm", "--port", str(mock_port)])
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
        if not args.no_mock_llm:
            _wait_http(f"http://127.0.0.1:{mock_port}/v1/models", 60, supervisor)
        key_file = _dev_key_file(settings)
        key = key_file.read_text().strip() if key_file.exists() else ""
        if not key or not asyncio.run(_key_works(settings, key)):
            key = asyncio.run(_create_key(settings, "dev"))
            key_file.write_text(key + "\n")
            key_file.chmod(0o600)
        print(f"\nagentmesh is up at {url}\n  development API key (user dev): {key}\n", flush=True)
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
        print(f"agentmesh up failed: {exc}", file=sys.stderr)
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


def _chat(args: argparse.Namespace) -> int:
    settings = load_settings()
    key = args.api_key or os.environ.get("AGENTMESH_API_KEY", "")
    if not key and _dev_key_file(settings).exists():
        key = _dev_key_file(settings).read_text().strip()
    url = args.url or f"http://{settings.gateway_host}:{settings.gateway_port}"
    body: dict[str, str] = {"agent": args.agent, "message": args.text}
    if args.trace:
        body["traceId"] = args.trace
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/api/chat", json=body, headers=headers, timeout=None) as resp:
        if resp.status_code != 200:
            resp.read()
            print(f"error {resp.status_code}: {resp.text}", file=sys.stderr)
            return 1
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            kind = event.get("type")
            if kind == "start":
                print(f"[trace {event['traceId']}]", file=sys.stderr)
            elif kind == "text-delta":
                print(event["textDelta"], end="", flush=True)
            elif kind == "tool-input-available":
                print(f"\n[tool {event['toolName']} {json.dumps(event.get('input'))}]", file=sys.stderr)
            elif kind == "a2a-task-started":
                print(f"[{event['calleeAgentName']} is working on task {event['taskId']}]", file=sys.stderr)
            elif kind == "subagent-update":
                sub = event["subagent"]
                print(f"[subagent {sub['name']}: {sub['status']}]", file=sys.stderr)
            elif kind == "error":
                print(f"\n[error {event.get('code')}: {event.get('message')}]", file=sys.stderr)
                return 1
            elif kind == "finish":
                print()
    return 0


def _health(args: argparse.Namespace) -> int:
    """One grpc.health.v1 Check with a deadline: 0 when ADDRESS reports SERVING, 1 otherwise (a
    container health check or a probe; no retries, no waiting for the server to come up)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    with grpc.insecure_channel(args.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            print(f"{args.address}: {exc.code().name} {exc.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _keys(args: argparse.Namespace) -> int:
    key = asyncio.run(_create_key(load_settings(), args.user))
    print(key)
    return 0


def _peers(args: argparse.Namespace) -> int:
    """`peers list` (the registry, never a secret) and `peers check` (does each answer, in time)."""
    from agentmesh.libs.peer_http import PeerClients
    from agentmesh.libs.peers import PeerConfigError, PeerRegistry

    settings = load_settings()
    try:
        registry = PeerRegistry.load(settings.peers)
    except PeerConfigError as exc:
        print(f"agentmesh peers: {exc}", file=sys.stderr)
        return 2
    if not len(registry):
        print("no peers registered (AGENTMESH_PEERS names the peer file)", file=sys.stderr)
        return 0 if args.peers_command == "list" else 1
    if args.peers_command == "list":
        for peer in registry:
            have = "set" if peer.credential and os.environ.get(peer.credential) else "unset"
            cred = f"{peer.credential} ({have})" if peer.credential else "-"
            print(f"{peer.alias}\t{peer.type}\t{peer.url}\t{cred}")
        return 0

    async def check() -> int:
        clients = PeerClients(settings.federation)
        try:
            results = await asyncio.gather(*(clients.of(p).healthy(args.timeout) for p in registry))
        finally:
            await clients.close()
        for peer, (ok, detail) in zip(registry, results, strict=True):
            print(f"{peer.alias}\t{peer.url}\t{'up' if ok else 'DOWN'}\t{detail}")
        return 0 if all(ok for ok, _ in results) else 1

    return asyncio.run(check())


def main(argv: list[str] | None = None) -> int:
    use_classic_transport()  # before anything below imports gRPC
    parser = argparse.ArgumentParser(prog="agentmesh", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the whole mesh on loopback")
    up.add_argument("--mock-port", type=int, default=8090)
    up.add_argument("--no-mock-llm", action="store_true", help="use AGENTMESH_LLM__BASE_URL instead")
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)
    health = sub.add_parser("health", help="exit 0 when a gRPC service reports SERVING, else 1")
    health.add_argument("address", help="host:port")
    health.add_argument("--service", default="", help="service name; empty: the whole server")
    health.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds")
    chat = sub.add_parser("chat", help="stream one chat turn to the terminal")
    chat.add_argument("--agent", required=True)
    chat.add_argument("--trace", "--session", dest="trace", default="", help="the trace (chat) to continue")
    chat.add_argument("--api-key", default="")
    chat.add_argument("--url", default="")
    chat.add_argument("text")
    agents_cli.add_parser(sub)
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key for a user (printed once)")
    create.add_argument("--user", required=True)
    peers = sub.add_parser("peers", help="the peer registry (AGENTMESH_PEERS)")
    peers_sub = peers.add_subparsers(dest="peers_command", required=True)
    peers_sub.add_parser("list", help="each peer: alias, type, URL, credential variable (never its value)")
    check = peers_sub.add_parser("check", help="does each peer's gateway answer (exit 1 when one does not)")
    check.add_argument("--timeout", type=float, default=3.0, help="seconds per peer")
    sub.add_parser("mock-llm", help="run the scripted OpenAI-compatible model server", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "mock-llm":
        from agentmesh.mock_llm import main as mock_main

        return mock_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "up":
        return _up(args)
    if args.command == "serve":
        return _serve(args.service)
    if args.command == "health":
        return _health(args)
    if args.command == "chat":
        return _chat(args)
    if args.command == "agents":
        return agents_cli.run(args)
    if args.command == "peers":
        return _peers(args)
    return _keys(args)


if __name__ == "__main__":
    sys.exit(main())
