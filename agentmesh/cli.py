"""The `agentmesh` command: up, serve SERVICE, health ADDRESS, chat, agents, keys create, peers, mock-llm.

Every failure is one line on stderr, `agentmesh <command>: <what went wrong>`, and a non-zero exit (1;
2 for a usage error or a malformed setting); a command that prints data takes `-o json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from pydantic import ValidationError

from agentmesh import __version__, agents_cli
from agentmesh.agents_cli import CliError
from agentmesh.libs.config import MeshSettings, load_settings
from agentmesh.libs.log import quiet_grpc_core
from agentmesh.libs.transport import use_classic_transport

if TYPE_CHECKING:
    import grpc

    from agentmesh.libs.identity import Signer
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

    setup_logging(name, settings.log_level, settings.log_json, access_log=settings.gateway_access_log)
    telemetry.setup(name)  # only with OTEL_EXPORTER_OTLP_ENDPOINT
    from agentmesh.libs.aio import run as run_loop

    try:
        run_loop(run(settings))
    except OSError as exc:  # its port (libs.rpc.BindError, libs.embedded_http.bind): no traceback
        logging.getLogger("agentmesh.serve").error("%s cannot start: %s", name, exc.strerror or exc)
        return 1
    except Exception:
        logging.getLogger("agentmesh.serve").exception("%s stopped on an error", name)
        return 1
    finally:
        telemetry.shutdown()
    return 0


async def _create_key(settings: MeshSettings, user: str, signer: Signer | None = None) -> str:
    from agentmesh.auth.v1 import auth_service_pb2 as au
    from agentmesh.libs.clients import Clients

    clients = Clients(settings, signer)
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


def _rpc_failure(exc: grpc.RpcError, service: str, target: str) -> CliError:
    """A failed call to the mesh, in one line that says what to do about it."""
    import grpc

    code: grpc.StatusCode | None = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return CliError(
            f"the mesh is not answering: the {service} service at {target} is {code.name.lower()}"
            " (is the mesh running? `agentmesh up` starts it)"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return CliError(
            f"the {service} service refused this command: its mesh secret is not this one"
            " (AGENTMESH_MESH_SECRET, or mesh_secret in AGENTMESH_DATA_DIR)"
        )
    return CliError(f"the {service} service answered {code.name if code else 'an error'}: {details}")


def _dev_key_file(settings: MeshSettings) -> Path:
    return settings.data_dir / "dev_api_key"


def _up(args: argparse.Namespace) -> int:
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
    settings.data_dir.mkdir(parents=True, exist_ok=True)
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
        key_file = _dev_key_file(settings)
        key = key_file.read_text().strip() if key_file.exists() else ""
        if not key or not asyncio.run(_key_works(settings, key)):
            key = asyncio.run(_create_key(settings, "dev"))
            key_file.write_text(key + "\n")
            key_file.chmod(0o600)
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


def _api_key(args: argparse.Namespace, settings: MeshSettings) -> str:
    """--api-key, else $AGENTMESH_API_KEY, else the development key `agentmesh up` wrote."""
    key = args.api_key or os.environ.get("AGENTMESH_API_KEY", "")
    if not key and _dev_key_file(settings).exists():
        key = _dev_key_file(settings).read_text().strip()
    if not key:
        raise CliError(
            "no API key: give --api-key, set AGENTMESH_API_KEY, or start the mesh with `agentmesh up`"
        )
    return key


def http_failure(resp: httpx.Response) -> str:
    """An error answer of the gateway in one line: `error 401 UNAUTHENTICATED: <message>`."""
    try:
        error = resp.json()["error"]
        return f"error {resp.status_code} {error['reason']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return f"error {resp.status_code}: {' '.join(resp.text.split())[:200]}"


def _chat(args: argparse.Namespace) -> int:
    settings = load_settings()
    key = _api_key(args, settings)
    url = args.url or f"http://{settings.gateway_host}:{settings.gateway_port}"
    body: dict[str, str] = {"agent": args.agent, "message": args.text}
    if args.trace:
        body["traceId"] = args.trace
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.stream("POST", f"{url}/api/chat", json=body, headers=headers, timeout=None) as resp:
            if resp.status_code != 200:
                resp.read()
                raise CliError(http_failure(resp))
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
                    print(
                        f"[{event['calleeAgentName']} is working on task {event['taskId']}]", file=sys.stderr
                    )
                elif kind == "subagent-update":
                    sub = event["subagent"]
                    print(f"[subagent {sub['name']}: {sub['status']}]", file=sys.stderr)
                elif kind == "error":
                    print(file=sys.stderr)
                    raise CliError(f"the turn failed: {event.get('code')}: {event.get('message')}")
                elif kind == "finish":
                    print()
    except httpx.HTTPError as exc:
        raise CliError(f"cannot reach the gateway at {url}: {exc or type(exc).__name__}") from exc
    return 0


def _health(args: argparse.Namespace) -> int:
    """One grpc.health.v1 Check with a deadline: 0 when ADDRESS reports SERVING, 1 otherwise (a
    container health check or a probe; no retries, no waiting for the server to come up)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    request = health_pb2.HealthCheckRequest(service=args.service)
    result: dict[str, Any] = {"address": args.address, "service": args.service}
    with grpc.insecure_channel(args.address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            result.update(status=code.name if code else "UNKNOWN", error=details)
            if args.output == "json":
                print(json.dumps(result))
            else:
                print(f"{args.address}: {result['status']} {details}", file=sys.stderr)
            return 1
    result["status"] = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(json.dumps(result) if args.output == "json" else f"{args.address}: {result['status']}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def _keys(args: argparse.Namespace) -> int:
    import grpc

    from agentmesh.libs.identity import Signer, load_secret

    settings = load_settings()
    try:  # never made here: a mesh that has none has not run in this data directory
        signer = Signer(load_secret(settings.mesh_secret, settings.data_dir, create=False))
    except RuntimeError as exc:
        raise CliError(f"{exc} (is the mesh running here? `agentmesh up` starts it)") from exc
    try:
        key = asyncio.run(_create_key(settings, args.user, signer))
    except grpc.RpcError as exc:
        raise _rpc_failure(exc, "trace", settings.addresses.trace) from exc
    print(json.dumps({"user": args.user, "apiKey": key}) if args.output == "json" else key)
    return 0


def _peers(args: argparse.Namespace) -> int:
    """`peers list` (the registry, never a secret) and `peers check` (does each answer, in time)."""
    from agentmesh.libs.peer_http import PeerClients
    from agentmesh.libs.peers import PeerConfigError, PeerRegistry

    settings = load_settings()
    as_json = args.output == "json"
    try:
        registry = PeerRegistry.load(settings.peers)
    except PeerConfigError as exc:
        print(f"agentmesh peers: {exc}", file=sys.stderr)
        return 2
    if not len(registry):
        if as_json:
            print("[]")
        else:
            print("no peers registered (AGENTMESH_PEERS names the peer file)", file=sys.stderr)
        return 0 if args.peers_command == "list" else 1
    if args.peers_command == "list":
        rows = []
        for peer in registry:
            have = bool(peer.credential and os.environ.get(peer.credential))
            rows.append({"alias": peer.alias, "type": peer.type, "url": peer.url,
                         "credential": peer.credential or None, "credentialSet": have})  # fmt: skip
            if not as_json:
                cred = f"{peer.credential} ({'set' if have else 'unset'})" if peer.credential else "-"
                print(f"{peer.alias}\t{peer.type}\t{peer.url}\t{cred}")
        if as_json:
            print(json.dumps(rows, indent=2))
        return 0

    async def check() -> int:
        clients = PeerClients(settings.federation)
        try:
            results = await asyncio.gather(*(clients.of(p).healthy(args.timeout) for p in registry))
        finally:
            await clients.close()
        rows = [
            {"alias": peer.alias, "url": peer.url, "up": ok, "detail": detail}
            for peer, (ok, detail) in zip(registry, results, strict=True)
        ]
        if as_json:
            print(json.dumps(rows, indent=2))
        for row in [] if as_json else rows:
            print(f"{row['alias']}\t{row['url']}\t{'up' if row['up'] else 'DOWN'}\t{row['detail']}")
        return 0 if all(ok for ok, _ in results) else 1

    return asyncio.run(check())


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentmesh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"agentmesh {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    output = argparse.ArgumentParser(add_help=False)
    output.add_argument("-o", "--output", choices=("text", "json"), default="text", help="default: text")
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
    serve = sub.add_parser("serve", help="run one service")
    serve.add_argument("service", choices=SERVICES)
    health = sub.add_parser(
        "health", parents=[output], help="exit 0 when a gRPC service reports SERVING, else 1"
    )
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
    create = keys_sub.add_parser("create", parents=[output], help="create a key for a user (printed once)")
    create.add_argument("--user", required=True)
    peers = sub.add_parser("peers", help="the peer registry (AGENTMESH_PEERS)")
    peers_sub = peers.add_subparsers(dest="peers_command", required=True)
    peers_sub.add_parser(
        "list", parents=[output], help="each peer: alias, type, URL, credential variable (never its value)"
    )
    check = peers_sub.add_parser(
        "check", parents=[output], help="does each peer's gateway answer (exit 1 when one does not)"
    )
    check.add_argument("--timeout", type=float, default=3.0, help="seconds per peer")
    sub.add_parser("mock-llm", help="run the scripted OpenAI-compatible model server", add_help=False)
    return parser


def _setting_error(exc: ValidationError) -> str:
    """A malformed AGENTMESH_* variable, named as the user wrote it."""
    first = exc.errors()[0]
    name = "AGENTMESH_" + "__".join(str(part) for part in first.get("loc", ())).upper()
    return f"invalid setting {name}: {first.get('msg', 'not valid')}"


def main(argv: list[str] | None = None) -> int:
    use_classic_transport()  # before anything below imports gRPC
    quiet_grpc_core()  # its lines would bypass the log format (libs/log.py)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "mock-llm":
        from agentmesh.mock_llm import main as mock_main

        return mock_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "up" and args.tokens_per_second is not None and (args.model_url or args.no_mock_llm):
        parser.error("--tokens-per-second paces the bundled model; it does not apply with another model")
    commands = {
        "up": _up,
        "serve": lambda a: _serve(a.service),
        "health": _health,
        "chat": _chat,
        "agents": agents_cli.run,
        "peers": _peers,
        "keys": _keys,
    }
    name = " ".join(
        part for part in (args.command, *(getattr(args, f"{args.command}_command", None) or "",)) if part
    )
    try:
        return int(commands[args.command](args))
    except CliError as err:
        print(f"agentmesh {name}: {err}", file=sys.stderr)
    except ValidationError as exc:
        print(f"agentmesh {name}: {_setting_error(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or a socket of this command
        where = f" {exc.filename}" if exc.filename else ""
        print(f"agentmesh {name}:{where} {exc.strerror or exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
