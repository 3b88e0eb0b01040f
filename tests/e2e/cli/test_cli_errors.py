"""The command line's conventions, as a user meets them (subprocesses): every failure is one line on
stderr and a non-zero exit, with no traceback (the mesh down, a bad key, a bad file, a bad setting, a
busy port); `--version`; `-o json` wherever a command prints data."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from agentmesh import __version__
from tests.mesh import Mesh, Ports


@dataclass
class Result:
    code: int
    out: str
    err: str

    def one_line_error(self, start: str) -> None:
        """Failed with exactly one line on stderr, starting so."""
        assert self.code != 0, self
        assert "Traceback" not in self.err, self.err
        assert self.err.count("\n") == 1 and self.err.startswith(start), self.err


async def cli(*args: str, env: dict[str, str]) -> Result:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def clean_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTMESH_")}
    env.update(AGENTMESH_DATA_DIR=str(data_dir), **extra)
    return env


@pytest.fixture(scope="module")
def ports() -> Iterator[Ports]:
    held = Ports()
    yield held
    held.release()


pytestmark = pytest.mark.mesh(rules={"rules": [], "default": {"text": "ok"}})


def mesh_env(mesh: Mesh, data_dir: Path) -> dict[str, str]:
    """Commands run against `mesh`: its trace address and secret, its gateway."""
    return clean_env(
        data_dir,
        AGENTMESH_ADDRESSES__TRACE=mesh.servers["trace"].target,
        AGENTMESH_MESH_SECRET=mesh.settings.mesh_secret,
        AGENTMESH_GATEWAY_PORT=mesh.url.rsplit(":", 1)[1],
    )


async def test_version() -> None:
    result = await cli("--version", env=dict(os.environ))
    assert (result.code, result.out) == (0, f"agentmesh {__version__}\n")


async def test_the_mesh_down(tmp_path: Path, ports: Ports) -> None:
    """Nothing listens where the commands look (reserved ports): one line each, exit 1."""
    (tmp_path / "mesh_secret").write_text("a-secret-of-a-mesh-that-is-not-running")
    env = clean_env(
        tmp_path,
        AGENTMESH_ADDRESSES__TRACE=f"127.0.0.1:{ports.take()}",
        AGENTMESH_GATEWAY_PORT=str(ports.take()),
        AGENTMESH_API_KEY="am_whatever",
    )
    trace = env["AGENTMESH_ADDRESSES__TRACE"]
    (await cli("keys", "create", "--user", "bob", env=env)).one_line_error(
        f"agentmesh keys create: the mesh is not answering: the trace service at {trace} is unavailable"
    )
    gateway = f"http://127.0.0.1:{env['AGENTMESH_GATEWAY_PORT']}"
    (await cli("chat", "--agent", "general", "hi", env=env)).one_line_error(
        f"agentmesh chat: cannot reach the gateway at {gateway}"
    )
    for verb in ("list", "show general"):
        (await cli("agents", *verb.split(), env=env)).one_line_error(
            f"agentmesh agents {verb.split()[0]}: cannot reach the gateway at {gateway}"
        )
    # A data directory no mesh has run in: nothing is created, the line says what to do.
    fresh = tmp_path / "fresh"
    result = await cli("keys", "create", "--user", "bob", env=clean_env(fresh))
    result.one_line_error("agentmesh keys create: no mesh secret")
    assert "agentmesh up" in result.err and not fresh.exists()


async def test_a_bad_key(mesh: Mesh, tmp_path: Path) -> None:
    env = mesh_env(mesh, tmp_path)
    (await cli("chat", "--agent", "general", "--api-key", "am_wrong", "hi", env=env)).one_line_error(
        "agentmesh chat: error 401 UNAUTHENTICATED: "
    )
    # The development key file holds something that is not a key (a stale mesh's, an edited file).
    (tmp_path / "dev_api_key").write_text("not a key\n")
    (await cli("chat", "--agent", "general", "hi", env=env)).one_line_error(
        "agentmesh chat: error 401 UNAUTHENTICATED: "
    )
    (await cli("agents", "list", env=env)).one_line_error("agentmesh agents list: agents: error 401: ")
    # A mesh secret that is not the mesh's: the trace service refuses the command's identity.
    wrong = {**env, "AGENTMESH_MESH_SECRET": "not-the-secret-of-this-mesh"}
    (await cli("keys", "create", "--user", "bob", env=wrong)).one_line_error(
        "agentmesh keys create: the trace service refused this command"
    )


async def test_bad_files_and_settings(mesh: Mesh, tmp_path: Path) -> None:
    env = mesh_env(mesh, tmp_path)
    env["AGENTMESH_API_KEY"] = mesh.api_key
    broken = tmp_path / "broken.yaml"
    broken.write_text("agents: [\n  - {slug: a\n")
    (await cli("agents", "apply", "-f", str(broken), env=env)).one_line_error(
        f"agentmesh agents apply: cannot read {broken}: "
    )
    (await cli("agents", "apply", "-f", str(tmp_path / "missing.yaml"), env=env)).one_line_error(
        f"agentmesh agents apply: cannot read {tmp_path / 'missing.yaml'}: "
    )
    (await cli("mock-llm", "--rules", str(broken), env=env)).one_line_error(
        f"agentmesh mock-llm: cannot load rules {broken}: not valid YAML: "
    )
    peers = tmp_path / "peers.yaml"
    peers.write_text("peers:\n  x: {url: 'http://h', api_key: secret}\n")
    result = await cli("peers", "list", env={**env, "AGENTMESH_PEERS": str(peers)})
    result.one_line_error("agentmesh peers: ")
    assert result.code == 2
    result = await cli("chat", "--agent", "general", "hi", env={**env, "AGENTMESH_GATEWAY_PORT": "eighty"})
    result.one_line_error("agentmesh chat: invalid setting AGENTMESH_GATEWAY_PORT: ")
    assert result.code == 2
    # A service whose port is taken says so in one log line and exits 1.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = f"127.0.0.1:{squatter.getsockname()[1]}"
        served = await cli(
            "serve",
            "stream",
            env={**clean_env(tmp_path), "AGENTMESH_ADDRESSES__STREAM": busy},
        )
        model = await cli("mock-llm", "--port", str(squatter.getsockname()[1]), env=env)
    assert served.code == 1 and "Traceback" not in served.err
    lines = [json.loads(x) for x in served.err.splitlines()]  # gRPC core's own line too is gone
    (line,) = [x for x in lines if x["level"] == "error"]
    assert (
        line["msg"]
        == f"stream cannot start: cannot listen on {busy}: the port is in use or the host is not this one"
    )
    model.one_line_error(f"agentmesh mock-llm: cannot listen on {busy}: ")


async def test_output_json(mesh: Mesh, tmp_path: Path) -> None:
    env = mesh_env(mesh, tmp_path)
    created = await cli("keys", "create", "--user", "carol", "-o", "json", env=env)
    assert created.code == 0, created.err
    body = json.loads(created.out)
    assert body["user"] == "carol" and body["apiKey"].startswith("am_")
    listed = await cli("agents", "list", "-o", "json", "--api-key", body["apiKey"], env=env)
    assert listed.code == 0 and "general" in {a["slug"] for a in json.loads(listed.out)}
    shown = await cli("agents", "show", "general", "-o", "json", "--api-key", body["apiKey"], env=env)
    assert shown.code == 0 and json.loads(shown.out)["slug"] == "general"

    trace = mesh.servers["trace"].target
    health = await cli("health", trace, "-o", "json", env=env)
    assert health.code == 0 and json.loads(health.out) == {
        "address": trace,
        "service": "",
        "status": "SERVING",
    }
    down = await cli("health", "127.0.0.1:1", "--timeout", "1", "-o", "json", env=env)
    assert down.code == 1 and json.loads(down.out)["status"] in ("UNAVAILABLE", "DEADLINE_EXCEEDED")

    peers = tmp_path / "peers.yaml"
    peers.write_text(yaml.safe_dump({"peers": {"self": {"url": mesh.url, "credential": "SELF_KEY"}}}))
    penv = {**env, "AGENTMESH_PEERS": str(peers), "SELF_KEY": mesh.api_key}
    listed_peers = await cli("peers", "list", "-o", "json", env=penv)
    assert listed_peers.code == 0
    assert json.loads(listed_peers.out) == [
        {"alias": "self", "type": "cloud", "url": mesh.url, "credential": "SELF_KEY", "credentialSet": True}
    ]
    assert mesh.api_key not in listed_peers.out
    checked = await cli("peers", "check", "-o", "json", env=penv)
    assert checked.code == 0
    assert json.loads(checked.out) == [{"alias": "self", "url": mesh.url, "up": True, "detail": "ok"}]
