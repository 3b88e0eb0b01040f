"""Three full meshes on loopback, each with its own ports and keys (issue 14's topology):

- org A "cloud" and org A "terminal" share one PostgreSQL database (hybrid mode,
  docs/requirements.md#shared-database-mode: named in the cloud's peer file as `trace_store.internal`,
  in the terminal's in the flat form `trace_store: {type: database, url}`), so their traces are local
  to each other with no HTTP;
- org B has its own database (SQLite) and is reached over HTTP
  (docs/requirements.md#remote-trace-store), in both directions: A's peer
  file registers B as `orgb`, B's registers A's cloud as `orga`; the terminal's registers B as
  `orgb` and, through a relay that can hang, as `orgbh`.

Each peer's key is in an environment variable the peer file names (never in the file).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.mesh import TEST_CATALOG, Mesh, Ports, start_mesh

RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": r"remote-continue (?P<slug>\S+) (?P<trace>\S+) (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [
                {
                    "name": "agent-invoke",
                    "arguments": {"agentSlug": "{slug}", "input": "{rest}", "continueFrom": "{trace}"},
                }
            ],
        },
        {
            "system": r"\[general\]",
            "user": r"remote-invoke (?P<slug>\S+) (?P<rest>.*)",
            "after_tool": False,
            "tool_calls": [{"name": "agent-invoke", "arguments": {"agentSlug": "{slug}", "input": "{rest}"}}],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "Result: {tool_results}"},
        {"system": r"\[coder\]", "text": "coder says: {user}"},
    ],
    "default": {"text": "default reply"},
}


class Proxy:
    """A TCP relay on a reserved loopback port in front of a peer's gateway: counts the bytes the peer
    sends back, can be taken down (connections refused) and can cut the answer after `cut_after` bytes
    (a peer that dies mid-read). Also a canary: `connections` counts every connection it accepted.
    `hold()` makes it a hung peer (it accepts connections and requests and never answers, until
    `release()`); `delay_s` a slow one (each request reaches the peer that much later)."""

    def __init__(self, port: int, target_port: int) -> None:
        self.port, self.target_port = port, target_port
        self.bytes_back = 0
        self.connections = 0
        self.cut_after: int | None = None
        self.delay_s = 0.0
        self.held: asyncio.Event | None = None  # set: released
        self.server: asyncio.base_events.Server | None = None
        self.open: set[asyncio.StreamWriter] = set()

    def hold(self) -> None:
        self.held = asyncio.Event()

    def release(self) -> None:
        """Answers again; the connections held so far are cut."""
        if self.held is not None:
            self.held.set()
            self.held = None

    async def up(self) -> None:
        if self.server is None:
            self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_port=True)

    async def down(self) -> None:
        if self.server is not None:
            self.server.close()
            for w in list(self.open):  # a peer that is gone takes its connections with it
                w.transport.abort()
            self.open.clear()
            await self.server.wait_closed()
            self.server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.held is not None:
            released = self.held
            self.open.add(writer)
            with contextlib.suppress(Exception):
                await reader.read(65536)  # the request arrives, and is never answered
                await released.wait()
            writer.transport.abort()
            self.open.discard(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.open |= {writer, up_w}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, back: bool) -> None:
            try:
                while data := await src.read(65536):
                    if not back and self.held is not None:  # a request on a kept-alive connection
                        released = self.held
                        await released.wait()
                        dst.transport.abort()
                        writer.transport.abort()
                        return
                    if not back and self.delay_s:
                        await asyncio.sleep(self.delay_s)  # a slow peer (the relay's pace, not a wait)
                    if back and self.cut_after is not None and self.bytes_back + len(data) > self.cut_after:
                        dst.write(data[: max(0, self.cut_after - self.bytes_back)])
                        await dst.drain()
                        dst.transport.abort()
                        up_w.transport.abort()
                        return
                    if back:
                        self.bytes_back += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        await asyncio.gather(pump(reader, up_w, False), pump(up_r, writer, True))


class Canary:
    """A listener that only counts the connections made to it (every one is a failure of SSRF checks),
    or, with `redirect_to`, answers every request with a 302 to that URL."""

    def __init__(self, port: int, redirect_to: str = "") -> None:
        self.port, self.redirect_to = port, redirect_to
        self.connections = 0
        self.server: asyncio.base_events.Server | None = None

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_port=True)

    async def down(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.redirect_to:
            with contextlib.suppress(Exception):
                await reader.readuntil(b"\r\n\r\n")
                head = f"HTTP/1.1 302 Found\r\nLocation: {self.redirect_to}\r\nContent-Length: 0\r\n\r\n"
                writer.write(head.encode())
                await writer.drain()
        writer.close()


@dataclass
class Fed:
    cloud: Mesh  # org A, PostgreSQL shared with terminal
    terminal: Mesh  # org A, the same PostgreSQL
    orgb: Mesh  # org B, its own SQLite database, reached over HTTP
    a_key_env: str  # the variable holding B's key for A's user (named in A's peer file)
    b_key_env: str
    peers_a: Path
    peers_b: Path
    proxy: Proxy  # org B behind a relay, registered in A's peer file as `orgbp`
    canary: Canary  # unregistered as 127.0.0.1; registered by name only: `named` is http://localhost:<port>
    redirector: Canary  # registered as `redir`: answers 302 to the canary
    hung: Proxy  # org B behind another relay, registered in the terminal's peer file as `orgbh`


def _catalog(tmp: Path, b_port: int, b_key_env: str) -> Path:
    """The test catalog, with remote callees allowed for `general`: peers' agents by alias, and
    `b-coder`, org B's coder catalogued as a remote A2A agent (its card at B's gateway)."""
    data = yaml.safe_load(TEST_CATALOG.read_text())
    data["agents"].append(
        {
            "slug": "b-coder",
            "name": "B's coder over A2A",
            "remote": {"cardUrl": f"http://127.0.0.1:{b_port}/a2a/coder", "credentialEnv": b_key_env},
        }
    )
    for agent in data["agents"]:
        if agent["slug"] == "general":
            agent["invoke"]["allowedCallees"] += ["@orgb/coder", "@orga/coder", "@orgbp/coder", "b-coder"]
        if agent["slug"] == "coder":
            agent["public"] = True  # served over A2A to other meshes
    path = tmp / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="package")
async def fed(tmp_path_factory: pytest.TempPathFactory, pg_url: str) -> AsyncIterator[Fed]:
    tmp = tmp_path_factory.mktemp("fed")
    ports = Ports()
    cloud_port, terminal_port, b_port, proxy_port = ports.take(), ports.take(), ports.take(), ports.take()
    canary_port, redirect_port, hung_port = ports.take(), ports.take(), ports.take()
    tag = uuid.uuid4().hex[:8].upper()
    a_env, b_env = f"FEDTEST_{tag}_ORGB_KEY", f"FEDTEST_{tag}_ORGA_KEY"
    peers_a = tmp / "peers-a.yaml"
    peers_a.write_text(
        yaml.safe_dump(
            {
                "trace_store": {
                    "internal": {"type": "database", "url": pg_url},
                    "external": {
                        "type": "remote",
                        "agents": [
                            {
                                "alias": "orgb",
                                "url": f"http://127.0.0.1:{b_port}",
                                "credential": a_env,
                                "type": "org",
                            },
                            {
                                "alias": "orgbp",
                                "url": f"http://127.0.0.1:{proxy_port}",
                                "credential": a_env,
                                "type": "org",
                            },
                            {"alias": "named", "url": f"http://localhost:{canary_port}", "type": "terminal"},
                            {"alias": "redir", "url": f"http://127.0.0.1:{redirect_port}", "type": "cloud"},
                        ],
                    },
                }
            }
        )
    )
    # the terminal's file takes the other shapes of the requirements: the flat `trace_store` form of the
    # shared database, and `agents:` mapping an alias to a peer
    peers_t = tmp / "peers-t.yaml"
    peers_t.write_text(
        yaml.safe_dump(
            {
                "trace_store": {"type": "database", "url": pg_url},
                "agents": {
                    "orgb": {"url": f"http://127.0.0.1:{b_port}", "credential": a_env, "type": "org"},
                    "orgbh": {"url": f"http://127.0.0.1:{hung_port}", "credential": a_env, "type": "org"},
                },
            }
        )
    )
    peers_b = tmp / "peers-b.yaml"
    peers_b.write_text(
        yaml.safe_dump(
            {
                "peers": {
                    "orga": {"url": f"http://127.0.0.1:{cloud_port}", "credential": b_env, "type": "cloud"}
                }
            }
        )
    )
    catalog = _catalog(tmp, b_port, a_env)
    # short bounds; no down memo (a test takes a peer down and up again at once): test_peer_http.py has
    # it; a read with a copy waits for its sync as long as a loaded machine may need (test_budgets.py
    # has the default short wait)
    fast = {
        "read_retries": 1,
        "backoff_s": 0.05,
        "timeout_s": 5.0,
        "connect_timeout_s": 1.0,
        "down_s": 0,
        "cached_read_wait_s": 5.0,
    }
    meshes: list[Mesh] = []
    # Each side's key exists only once the other side is up: the variables hold a placeholder at the
    # start (an unset one stops it), the real keys right after (a key is read at each call).
    os.environ[a_env] = os.environ[b_env] = "not-yet"
    try:
        # org A: no AGENTMESH_DATABASE_URL; the peer file's trace_store.internal names the shared database
        cloud = await start_mesh(
            tmp / "cloud", rules=RULES, catalog=catalog, gateway_port=cloud_port, peers=str(peers_a),
            federation=fast,
        )  # fmt: skip
        meshes.append(cloud)
        # the terminal reads a cached trace with the default wait (test_three_meshes.py: a hung relay)
        terminal_fed = {k: v for k, v in fast.items() if k != "cached_read_wait_s"}
        terminal = await start_mesh(
            tmp / "terminal", rules=RULES, catalog=catalog, gateway_port=terminal_port, peers=str(peers_t),
            federation=terminal_fed,
        )  # fmt: skip
        meshes.append(terminal)
        orgb = await start_mesh(
            tmp / "orgb",
            rules=RULES,
            catalog=catalog,
            gateway_port=b_port,
            peers=str(peers_b),
            federation=fast,
        )
        meshes.append(orgb)
        os.environ[a_env] = orgb.api_key  # A's user reads org B as B's alice
        os.environ[b_env] = cloud.api_key
        proxy = Proxy(proxy_port, b_port)
        await proxy.up()
        canary = Canary(canary_port)
        await canary.up()
        redirector = Canary(redirect_port, redirect_to=f"http://127.0.0.1:{canary_port}/api/traces/x")
        await redirector.up()
        hung = Proxy(hung_port, b_port)
        await hung.up()
        yield Fed(cloud, terminal, orgb, a_env, b_env, peers_a, peers_b, proxy, canary, redirector, hung)
        hung.release()
        await hung.down()
        await proxy.down()
        await canary.down()
        await redirector.down()
    finally:
        os.environ.pop(a_env, None)
        os.environ.pop(b_env, None)
        for m in reversed(meshes):
            await m.stop()
        ports.release()
