"""A whole mesh in the test's event loop: the scripted model server, the four gRPC services on
loopback ports and the gateway on a real uvicorn, talking to each other as in production."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from google.protobuf import json_format

from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.gateway.app import create_app
from agentmesh.gateway.server import http_limits
from agentmesh.libs import embedded_http, events, identity
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import A2ASettings, Addresses, LLMSettings, MeshSettings, StreamSettings
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import ServiceServer
from agentmesh.mock_llm import DEMO_RULES, MockLLM
from agentmesh.services.agent_runtime import server as runtime_server
from agentmesh.services.orchestrator import server as orchestrator_server
from agentmesh.services.stream import server as stream_server
from agentmesh.services.trace import server as trace_server

ANY_PORT = "127.0.0.1:0"
TEST_CATALOG = Path(__file__).parent / "catalogs" / "mesh.yaml"  # agents whose prompts the test rules match


# A model rule: the general agent, asked "tree ...", calls agent-invoke on coder and delegate_parallel
# to one helper subagent in one step (a turn whose work spans every service).
TREE_RULE: dict[str, Any] = {
    "system": r"\[general\]",
    "user": "^tree",
    "after_tool": False,
    "tool_calls": [
        {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "callee"}},
        {"name": "delegate_parallel", "arguments": {"tasks": [{"goal": "sub", "agentSlug": "helper"}]}},
    ],
}


class Ports:
    """Ports for processes started by a test, reserved until the test ends. Each is bound here (to
    127.0.0.1, never listened on) by a socket that is alone on it when it binds, and only then marks
    itself SO_REUSEADDR: the kernel hands the port to no bind(0) or outgoing connection and refuses it
    to any other bind, but the one process that serves on it binds and listens as servers do (with
    SO_REUSEADDR, which Linux allows beside a socket that is not listening). No server shares a port
    (none sets SO_REUSEPORT): once one listens, every other bind of the port fails."""

    def __init__(self) -> None:
        self._held: list[socket.socket] = []

    @staticmethod
    def _hold(port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))  # fails on a port anybody has, a reservation included
        except OSError:
            sock.close()
            raise
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # lets the server in
        return sock

    def take(self) -> int:
        sock = self._hold(0)
        self._held.append(sock)
        return int(sock.getsockname()[1])

    def take_range(self, count: int) -> int:
        """`count` consecutive ports reserved the same way; the first (for `agentmesh up --port-base`).
        Picked below the kernel's ephemeral range, which bind(0) and outgoing connections draw from."""
        rng = random.Random()
        for _ in range(200):
            base = rng.randrange(20_000, 32_000 - count)
            held: list[socket.socket] = []
            try:
                for port in range(base, base + count):
                    held.append(self._hold(port))
            except OSError:
                for sock in held:
                    sock.close()
                continue
            self._held.extend(held)
            return base
        raise RuntimeError(f"no {count} consecutive free ports found")

    def release(self) -> None:
        for sock in self._held:
            sock.close()
        self._held.clear()


@dataclass
class Mesh:
    settings: MeshSettings
    mock: MockLLM
    servers: dict[str, ServiceServer] = field(default_factory=dict)
    gateway: embedded_http.EmbeddedServer | None = None
    clients: Clients | None = None
    url: str = ""
    api_key: str = ""
    user: str = ""

    @property
    def signer(self) -> Signer:
        assert self.clients is not None
        return self.clients.signer

    def http(self, api_key: str | None = None, timeout: float = 30.0) -> httpx.AsyncClient:
        key = self.api_key if api_key is None else api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout)

    async def new_user(self, name: str) -> str:
        assert self.clients is not None
        with identity.acting_as(""):
            resp = await self.clients.auth.CreateApiKey(au.CreateApiKeyRequest(user=name))
        return resp.api_key

    async def stop(self) -> None:
        if self.gateway is not None:
            with contextlib.suppress(Exception):
                await self.gateway.stop()
        for name in ("orchestrator", "agent-runtime", "stream", "trace"):
            server = self.servers.get(name)
            if server is not None:
                await server.stop(1.0)
        if self.clients is not None:
            await self.clients.close()
        await self.mock.stop()
        if self.settings.stream.backend == "redis":  # leave no keys of this run behind
            client = aioredis.Redis.from_url(self.settings.redis_url)
            keys = [k async for k in client.scan_iter(f"{self.settings.stream.redis_prefix}*")]
            if keys:
                await client.delete(*keys)
            await client.aclose()


async def start_mesh(
    tmp: Path,
    *,
    database_url: str = "",
    stream_backend: str = "memory",
    redis_url: str = "",
    rules: Any = None,
    catalog: Path | None = None,
    llm_timeout_s: float = 10.0,
    stream_options: dict[str, Any] | None = None,
    gateway_port: int = 0,
    tokens_per_second: float = 0.0,
    **overrides: Any,
) -> Mesh:
    """The whole mesh in this loop. The model answers at once unless `tokens_per_second` slows it (a
    rule's own pace still wins)."""
    timing = {"ttft_ms": 0.0, "tokens_per_second": tokens_per_second}
    mock = MockLLM(rules, **timing) if rules is not None else MockLLM.from_file(DEMO_RULES, **timing)
    await mock.start()
    values: dict[str, Any] = {
        "data_dir": tmp,
        "database_url": database_url,
        "mesh_secret": f"test-secret-{uuid.uuid4().hex}",
        "addresses": Addresses(
            orchestrator=ANY_PORT, agent_runtime=ANY_PORT, trace=ANY_PORT, stream=ANY_PORT
        ),
        "llm": LLMSettings(base_url=mock.base_url, api_key="test", request_timeout_s=llm_timeout_s),
        "stream": StreamSettings(
            **{
                "backend": stream_backend,
                "heartbeat_s": 5,
                "redis_prefix": f"test-{uuid.uuid4().hex}:",
                **(stream_options or {}),
            }
        ),
        "shutdown_grace_s": 2.0,
        "log_json": False,
        "a2a": A2ASettings(grpc_listen=ANY_PORT),  # never the default port of a running mesh
    }
    if redis_url:
        values["redis_url"] = redis_url
    if catalog is not None:
        values["catalog"] = catalog
    values.update(overrides)
    settings = MeshSettings(**values)
    signer = identity.signer_for(settings)
    mesh = Mesh(settings=settings, mock=mock)
    try:
        # Each server binds port 0; the addresses are filled in as they come up, before any RPC
        # (clients open their channels on first use).
        a = settings.addresses
        mesh.servers["trace"] = await trace_server.build(settings, ANY_PORT, signer)
        a.trace = mesh.servers["trace"].target
        stream = await stream_server.build(settings, ANY_PORT, signer=signer)
        mesh.servers["stream"] = await stream.start()
        a.stream = stream.target
        mesh.servers["agent-runtime"] = await runtime_server.build(settings, ANY_PORT, signer)
        a.agent_runtime = mesh.servers["agent-runtime"].target
        mesh.servers["orchestrator"] = await orchestrator_server.build(settings, ANY_PORT, signer)
        a.orchestrator = mesh.servers["orchestrator"].target
        mesh.clients = Clients(settings, signer)
        mesh.gateway = await embedded_http.serve(create_app(settings), port=gateway_port, **http_limits())
        mesh.url = f"http://127.0.0.1:{mesh.gateway.port}"
        mesh.user = "alice"
        mesh.api_key = await mesh.new_user("alice")
    except BaseException:
        await mesh.stop()
        raise
    return mesh


async def sse_events(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Parses an SSE response into event dicts (with `_id` from the `id:` line)."""
    event_id = None
    async for line in resp.aiter_lines():
        if line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data = json.loads(line[5:].strip())
            data["_id"] = event_id
            yield data
        elif line == "":
            event_id = None


class SseReader:
    """Follows one SSE route to its end, as a browser does: with `reconnect`, a connection or gateway
    that goes away is retried with Last-Event-ID until a terminal event arrives. `client()` makes the
    HTTP client (a fresh one per attempt, so a restarted gateway is reached). Each event carries `_t`
    (monotonic seconds). A 200 JSON `{"active": false}` (no buffer any more) ends it with a synthetic
    `{"type": "error", "code": "no-buffer"}`; another non-SSE answer with `{"code": "http-<status>"}`.
    `first` is a response already open (a POST /api/chat) to read before any reconnect to `path`;
    `on_event(event)` sees each event and may return True to drop the connection there (the reader
    resumes as after a network cut) or change `path` (a new session's id known from its first event).
    With `reconnect`, a 502/503/504 is retried too, as the web UI does."""

    def __init__(
        self,
        client: Callable[[], httpx.AsyncClient],
        path: str,
        *,
        first: httpx.Response | None = None,
        reconnect: bool = False,
        on_event: Callable[[dict[str, Any]], bool] | None = None,
    ) -> None:
        self.client, self.path, self.reconnect, self.on_event = client, path, reconnect, on_event
        self.events: list[dict[str, Any]] = []
        self.status = 0
        self.connections = 0
        self.live = asyncio.Event()  # a text delta arrived
        self.started = time.monotonic()
        self.task = asyncio.create_task(self._run(first))

    @property
    def ended(self) -> bool:
        return bool(self.events) and self.events[-1]["type"] in ("done", "error")

    @property
    def end(self) -> dict[str, Any]:
        return self.events[-1] if self.events else {}

    @property
    def last(self) -> str:
        return self.end.get("type", "")

    @property
    def text(self) -> str:
        return "".join(e["textDelta"] for e in self.events if e["type"] == "text-delta")

    @property
    def silence_before_end(self) -> float:
        """Seconds between the event (or connection) before the terminal event and the terminal one."""
        if not self.ended:
            return float("nan")
        before = self.events[-2]["_t"] if len(self.events) > 1 else self.started
        return self.events[-1]["_t"] - before

    async def _run(self, first: httpx.Response | None) -> None:
        while not self.ended:
            try:
                if first is not None:
                    response, first = first, None
                    try:
                        await self._read(response)
                    finally:
                        await response.aclose()
                elif not self.path:
                    self._add({"type": "error", "code": "lost-before-start"})
                else:
                    async with self.client() as http:
                        last = next((e["_id"] for e in reversed(self.events) if e.get("_id")), "")
                        headers = {"Last-Event-ID": last} if last else {}
                        async with http.stream("GET", self.path, headers=headers) as resp:
                            await self._read(resp)
            except (httpx.TransportError, httpx.RemoteProtocolError):
                if not self.reconnect:
                    self._add({"type": "error", "code": "disconnected"})
            if not self.ended and not self.reconnect:
                return
            if not self.ended:
                await asyncio.sleep(0.2)  # the gateway is away: a browser retries

    async def _read(self, resp: httpx.Response) -> None:
        self.status = resp.status_code
        self.connections += 1
        if resp.status_code in (502, 503, 504) and self.reconnect:
            return  # a service behind the gateway is coming back: retried
        if resp.status_code != 200 or not resp.headers["content-type"].startswith("text/event-stream"):
            body = await resp.aread()
            gone = resp.status_code == 200 and json.loads(body).get("active") is False
            self._add({"type": "error", "code": "no-buffer" if gone else f"http-{resp.status_code}"})
            return
        async for event in sse_events(resp):
            self._add(event)
            if event["type"] == "text-delta":
                self.live.set()
            if self.on_event is not None and self.on_event(event) and not self.ended:
                return

    def _add(self, event: dict[str, Any]) -> None:
        event["_t"] = time.monotonic()
        self.events.append(event)


async def wait_live(readers: list[SseReader], timeout: float) -> None:
    """Waits until every reader got a text delta; fails (saying what each one saw) at the deadline or
    as soon as one ended without one."""

    async def one(reader: SseReader) -> None:
        live = asyncio.create_task(reader.live.wait())
        await asyncio.wait({live, reader.task}, return_when=asyncio.FIRST_COMPLETED)
        live.cancel()
        if not reader.live.is_set():
            raise AssertionError(f"{reader.path} ended before any text: {_seen(reader)}")

    try:
        await asyncio.wait_for(asyncio.gather(*(one(r) for r in readers)), timeout)
    except TimeoutError:
        waiting = "; ".join(f"{r.path}: {_seen(r)}" for r in readers if not r.live.is_set())
        raise AssertionError(f"no text within {timeout}s from {waiting}") from None


def _seen(reader: SseReader) -> str:
    kinds = [e.get("code") or e["type"] for e in reader.events[-4:]]
    return f"HTTP {reader.status}, {reader.connections} connections, last events {kinds}"


async def chat(
    mesh: Mesh,
    agent: str,
    message: str,
    session_id: str | None = None,
    api_key: str | None = None,
    timeout: float = 30.0,
) -> list[dict[str, Any]]:
    """One full turn over POST /api/chat; returns every SSE event until the stream ends."""
    body: dict[str, Any] = {"agent": agent, "message": message}
    if session_id:
        body["sessionId"] = session_id
    out: list[dict[str, Any]] = []
    async with (
        mesh.http(api_key, timeout=timeout) as http,
        http.stream("POST", "/api/chat", json=body) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        async with asyncio.timeout(timeout):
            async for event in sse_events(resp):
                out.append(event)
    return out


async def read_buffer(mesh: Mesh, key: str) -> list[Any]:
    """Every event of buffer `key` (as the mesh's user) from its start to its terminal one."""
    assert mesh.clients is not None
    out: list[Any] = []
    with identity.acting_as(mesh.user):
        follow = mesh.clients.follows.follow(key, idle_timeout_ms=5000)
    async with asyncio.timeout(10):
        async for event in follow:
            out.append(event)
            if events.is_terminal(event):
                break
    return out


async def wait_until(predicate: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    """Polls an async or sync predicate until it returns a truthy value, or fails at the deadline.
    For state that has no event to wait on (rows written by another service)."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                value = predicate()
                if asyncio.iscoroutine(value):
                    value = await value
                if value:
                    return value
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def wait_request(
    mock: MockLLM, predicate: Any, timeout: float = 10.0, start: int = 0
) -> dict[str, Any]:
    """Waits until the model server has received (at index >= start) a request body for which
    predicate(body) holds."""
    seen = start
    async with asyncio.timeout(timeout):
        while True:
            bodies = await mock.wait_requests(seen + 1, timeout=timeout)
            for body in bodies[seen:]:
                if predicate(body):
                    return body
            seen = len(bodies)


def system_of(body: dict[str, Any]) -> str:
    return str(body["messages"][0]["content"]) if body["messages"][0]["role"] == "system" else ""


BACKENDS = ["sqlite-memory", "postgres-redis"]  # the backend pairs of the mesh fixtures (tests/conftest.py)


def backend_urls(request: Any) -> tuple[str, str]:
    """(database URL, Redis URL) of the backend pair named by `request.param` (one of BACKENDS): empty
    for sqlite-memory, the embedded default."""
    if request.param == "postgres-redis":
        return request.getfixturevalue("pg_url"), request.getfixturevalue("redis_url")
    return "", ""


def process_env(data_dir: Path, ports: Ports, **extra: str) -> dict[str, str]:
    """Environment for mesh processes (`agentmesh up` / `serve`) on loopback ports reserved in `ports`."""
    env = dict(os.environ)
    env.update(
        AGENTMESH_DATA_DIR=str(data_dir),
        AGENTMESH_ADDRESSES__TRACE=f"127.0.0.1:{ports.take()}",
        AGENTMESH_ADDRESSES__STREAM=f"127.0.0.1:{ports.take()}",
        AGENTMESH_ADDRESSES__AGENT_RUNTIME=f"127.0.0.1:{ports.take()}",
        AGENTMESH_ADDRESSES__ORCHESTRATOR=f"127.0.0.1:{ports.take()}",
        AGENTMESH_GATEWAY_PORT=str(ports.take()),
        AGENTMESH_A2A__GRPC_LISTEN=f"127.0.0.1:{ports.take()}",
        **extra,
    )
    return env


SERVICE_ORDER = ("trace", "stream", "agent-runtime", "orchestrator", "gateway")  # callees first


def log_file(path: Path) -> Any:
    """An append-mode file for a child process's stderr (the caller closes it once the child has it)."""
    return path.open("ab")


@dataclass
class Instance:
    """One process of a ProcessMesh: which service it runs and what its environment adds to the mesh's
    (with replicas: where this one listens, its metrics port, its gateway port)."""

    service: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ProcessMesh:
    """A mesh of real processes (`agentmesh serve <service>`) on reserved loopback ports, with the
    scripted model server in the test's loop: for killing and restarting services. With replicas, each
    service but trace runs as `<service>-1`, `<service>-2`, ...: each binds its own port
    (AGENTMESH_LISTEN__*) and the mesh dials them all round robin (`ipv4:a,b` in AGENTMESH_ADDRESSES__*);
    the gateways are independent processes on their own ports (a browser picks one)."""

    env: dict[str, str]
    ports: Ports
    mock: MockLLM
    settings: MeshSettings  # the same addresses and secret, for the test's own clients
    procs: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)
    clients: Clients | None = None
    api_key: str = ""
    user: str = "alice"
    instances: dict[str, Instance] = field(default_factory=dict)  # by process name

    def instance(self, name: str) -> Instance:
        return self.instances.get(name) or Instance(name)

    def names(self, service: str) -> list[str]:
        """The process names of `service`, in order."""
        return [n for n in self.instances if self.instances[n].service == service] or [service]

    def env_of(self, name: str) -> dict[str, str]:
        return {**self.env, **self.instance(name).env}

    def gateway_url(self, name: str = "") -> str:
        """The URL of gateway `name` (default: the first one still running, else the first)."""
        gateways = self.names("gateway")
        if not name:
            name = next((g for g in gateways if g in self.procs), gateways[0])
        return f"http://127.0.0.1:{self.env_of(name)['AGENTMESH_GATEWAY_PORT']}"

    @property
    def url(self) -> str:
        return self.gateway_url(self.names("gateway")[0])

    def http(self, timeout: float = 30.0, gateway: str | None = None) -> httpx.AsyncClient:
        """A client of one gateway: `gateway` by name, "" for the first one running, None for the first."""
        url = self.url if gateway is None else self.gateway_url(gateway)
        return httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {self.api_key}"}, timeout=timeout
        )

    def metrics_url(self, name: str) -> str:
        """GET /metrics of process `name` (the gateway's is on its HTTP port)."""
        inst = self.instance(name)
        if inst.service == "gateway":
            return f"{self.gateway_url(name)}/metrics"
        key = inst.service.upper().replace("-", "_")
        return f"http://{self.env_of(name)[f'AGENTMESH_METRICS__{key}']}/metrics"

    async def start(self, name: str) -> None:
        """Starts process `name` and waits until it serves."""
        inst = self.instance(name)
        env = self.env_of(name)
        log = log_file(Path(env["AGENTMESH_DATA_DIR"]) / f"{name}.log")
        self.procs[name] = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agentmesh.cli", "serve", inst.service, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=log,
        )  # fmt: skip
        log.close()
        if inst.service == "gateway":
            await wait_until(lambda: self._gateway_up(name), 30, f"{name} to answer")
            return
        from agentmesh.libs.rpc import wait_serving

        key = inst.service.upper().replace("-", "_")
        target = env.get(f"AGENTMESH_LISTEN__{key}") or env[f"AGENTMESH_ADDRESSES__{key}"]
        await wait_serving(target, timeout_s=30)

    async def _gateway_up(self, name: str = "") -> bool:
        try:
            async with httpx.AsyncClient(base_url=self.gateway_url(name), timeout=1) as http:
                return (await http.get("/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def kill(self, name: str) -> None:
        """SIGKILL: the process cannot clean anything up."""
        proc = self.procs.pop(name)
        proc.kill()
        await proc.wait()

    async def stop(self) -> None:
        order = {service: i for i, service in enumerate(SERVICE_ORDER)}
        for name in sorted(self.procs, key=lambda n: -order.get(self.instance(n).service, 0)):
            proc = self.procs.pop(name)
            if proc.returncode is None:
                proc.terminate()
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
        if self.clients is not None:
            await self.clients.close()
        await self.mock.stop()
        self.ports.release()


@dataclass
class Tree:
    """Every row of a session's tree: its messages, its agent-invoke tasks and subagent rows, and the
    messages of their child traces."""

    messages: list[Any]
    tasks: list[Any]
    subagents: list[Any]

    @property
    def open_rows(self) -> list[str]:
        """The rows still pending, submitted, working, queued or running."""
        from agentmesh.events.v1 import events_pb2 as ev
        from agentmesh.trace.v1 import trace_pb2 as tp

        out = [f"message {m.id}" for m in self.messages if m.status == tp.MESSAGE_STATUS_PENDING]
        out += [
            f"task {t.id}" for t in self.tasks if t.state in (tp.TASK_STATE_SUBMITTED, tp.TASK_STATE_WORKING)
        ]
        running = (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING)
        out += [f"subagent {s.id}" for s in self.subagents if s.status in running]
        for m in self.messages:  # the cards stored in a turn's anchor (metadata.subagents)
            batches = json_format.MessageToDict(m.metadata).get("subagents", [])
            out += [
                f"card {item.get('id')} of message {m.id}"
                for batch in batches
                for item in batch.get("items", [])
                if item.get("status") in ("queued", "running")
            ]
        return out


async def read_tree(mesh: ProcessMesh, session: str) -> Tree | None:
    """The session's tree as the trace service has it, or None while the trace service is away."""
    from agentmesh.trace.v1 import message_service_pb2 as ms
    from agentmesh.trace.v1 import subagent_service_pb2 as sbs
    from agentmesh.trace.v1 import task_service_pb2 as tks

    assert mesh.clients is not None
    try:
        with identity.acting_as(mesh.user):
            c = mesh.clients
            every, full = ms.PATH_MODE_ALL, ms.MESSAGE_VIEW_FULL  # (as the web UI reads a chat)
            msgs = list(
                (
                    await c.messages.ListMessages(
                        ms.ListMessagesRequest(trace_id=session, mode=every, view=full)
                    )
                ).messages
            )
            tasks = (await c.tasks.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=session))).tasks
            subs = (
                await c.subagents.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=session))
            ).subagents
            for child in [task.trace_id for task in tasks] + [s.child_trace_id for s in subs]:
                msgs += (
                    await c.messages.ListMessages(ms.ListMessagesRequest(trace_id=child, mode=every))
                ).messages
    except Exception:  # the trace service is coming back
        return None
    return Tree(msgs, list(tasks), list(subs))


async def start_process_mesh(
    tmp: Path,
    rules: Any,
    *,
    database_url: str = "",
    redis_url: str = "",
    lease_s: float = 2.0,
    replicas: int = 1,
    metrics: bool = False,
    extra_env: dict[str, str] | None = None,
) -> ProcessMesh:
    """Every service as its own process (`replicas` of each but trace, which owns the database
    connection pool and runs once); the model server here. Short leases (`lease_s`) so what a killed
    process leaves behind is settled within seconds. `metrics`: each gRPC process serves GET /metrics
    on a port of its own (ProcessMesh.metrics_url)."""
    mock = MockLLM(rules, ttft_ms=0.0, tokens_per_second=0.0)
    await mock.start()
    ports = Ports()
    secret = f"test-secret-{uuid.uuid4().hex}"
    extra = {
        "AGENTMESH_MESH_SECRET": secret,
        "AGENTMESH_LEASE_S": str(lease_s),
        "AGENTMESH_STREAM__LEASE_S": str(lease_s),
        "AGENTMESH_LLM__BASE_URL": mock.base_url,
        "AGENTMESH_LLM__API_KEY": "test",
        "AGENTMESH_CATALOG": str(TEST_CATALOG),
        "AGENTMESH_SHUTDOWN_GRACE_S": "1",
        "AGENTMESH_LOG_LEVEL": "INFO",
        "AGENTMESH_DATABASE_URL": database_url,
        **(extra_env or {}),
    }
    if redis_url:
        extra.update(
            AGENTMESH_STREAM__BACKEND="redis",
            AGENTMESH_REDIS_URL=redis_url,
            AGENTMESH_STREAM__REDIS_PREFIX=f"test-{uuid.uuid4().hex}:",
        )
    env = process_env(tmp, ports, **extra)
    instances: dict[str, Instance] = {}
    for service in SERVICE_ORDER:
        key = service.upper().replace("-", "_")
        count = 1 if service == "trace" else replicas
        names = [service] if count == 1 else [f"{service}-{i + 1}" for i in range(count)]
        listen = [env[f"AGENTMESH_ADDRESSES__{key}"]] if service != "gateway" else []
        if service != "gateway" and count > 1:
            listen = [f"127.0.0.1:{ports.take()}" for _ in names]
            env[f"AGENTMESH_ADDRESSES__{key}"] = "ipv4:" + ",".join(listen)
        for i, name in enumerate(names):
            own: dict[str, str] = {}
            if service == "gateway":
                own["AGENTMESH_GATEWAY_PORT"] = env["AGENTMESH_GATEWAY_PORT"] if i == 0 else str(ports.take())
            else:
                own[f"AGENTMESH_LISTEN__{key}"] = listen[i]
                if metrics:
                    own[f"AGENTMESH_METRICS__{key}"] = f"127.0.0.1:{ports.take()}"
            instances[name] = Instance(service, own)
    a = Addresses(
        trace=env["AGENTMESH_ADDRESSES__TRACE"],
        stream=env["AGENTMESH_ADDRESSES__STREAM"],
        agent_runtime=env["AGENTMESH_ADDRESSES__AGENT_RUNTIME"],
        orchestrator=env["AGENTMESH_ADDRESSES__ORCHESTRATOR"],
    )
    settings = MeshSettings(data_dir=tmp, mesh_secret=secret, addresses=a, database_url=database_url)
    mesh = ProcessMesh(env=env, ports=ports, mock=mock, settings=settings, instances=instances)
    try:
        for service in SERVICE_ORDER:  # callees first; the replicas of one service together
            await asyncio.gather(*(mesh.start(name) for name in mesh.names(service)))
        mesh.clients = Clients(settings)
        with identity.acting_as(""):
            mesh.api_key = (
                await mesh.clients.auth.CreateApiKey(
                    au.CreateApiKeyRequest(user=mesh.user), timeout=60, wait_for_ready=True
                )
            ).api_key  # a loaded machine may take a while to answer a new connection
    except BaseException:
        await mesh.stop()
        raise
    return mesh
