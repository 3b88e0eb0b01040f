"""`agentmesh peers list|check`: the registry without its secrets; whether each peer answers, in time."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.e2e.federation.conftest import Fed
from tests.mesh import Ports


async def run_cli(*args: str, env: dict[str, str]) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", "peers", *args, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_list_and_check(fed: Fed, tmp_path: Path) -> None:
    ports = Ports()
    hole = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    hole.bind(("127.0.0.1", 0))
    hole.listen(8)
    closed = ports.take()  # reserved, never listened on: connections are refused
    path = tmp_path / "peers.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "peers": {
                    "orgb": {"url": fed.orgb.url, "credential": fed.a_key_env, "type": "org"},
                    "silent": {"url": f"http://127.0.0.1:{hole.getsockname()[1]}", "type": "terminal"},
                    "gone": {"url": f"http://127.0.0.1:{closed}", "type": "cloud"},
                }
            }
        )
    )
    env = {**os.environ, "AGENTMESH_PEERS": str(path)}
    try:
        code, out, _ = await run_cli("list", env=env)
        assert code == 0
        assert "orgb\torg\t" in out and f"{fed.a_key_env} (set)" in out and "silent\tterminal" in out
        assert fed.orgb.api_key not in out  # never the secret
        started = time.monotonic()
        code, out, _ = await run_cli("check", "--timeout", "1", env=env)
        took = time.monotonic() - started
    finally:
        hole.close()
        ports.release()
    lines = {line.split("\t")[0]: line for line in out.splitlines()}
    assert code == 1  # one peer or more is down
    assert "\tup\t" in lines["orgb"]
    assert "DOWN" in lines["silent"] and "no answer within 1s" in lines["silent"]
    assert "DOWN" in lines["gone"]
    assert took < 10, "the check is bounded by its timeout (peers are checked together)"


async def test_no_registry(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AGENTMESH_PEERS"}
    code, _, err = await run_cli("list", env=env)
    assert code == 0 and "no peers registered" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("peers: {p: {url: 'http://h', api_key: am_x}}\n")
    code, _, err = await run_cli("list", env={**env, "AGENTMESH_PEERS": str(bad)})
    assert code == 2 and "never goes in the file" in err and "am_x" not in err


async def test_check_of_a_file_validates_it_and_contacts_nothing(fed: Fed, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AGENTMESH_PEERS"}
    good = tmp_path / "good.yaml"
    good.write_text(
        yaml.safe_dump(
            {
                "trace_store": {"type": "database", "url": "postgresql://org-db/traces"},
                "agents": {
                    "canary": {"url": f"http://127.0.0.1:{fed.canary.port}", "credential": fed.a_key_env}
                },
            }
        )
    )
    before = fed.canary.connections
    code, out, err = await run_cli("check", str(good), env=env)
    assert code == 0, err
    assert out.startswith(f"{good}: valid") and "canary" in out and "shared database: yes" in out
    assert fed.canary.connections == before  # nothing was contacted
    cases = {
        "peer: {t: {url: 'http://t'}}\n": "(top level): unknown key 'peer': expected one of agents, peers",
        "trace_store: {type: database, url: 'mongodb://db/t'}\n": "trace_store.url: unsupported database",
        "peers: {t: {url: 'http://t', credential: FEDTEST_NEVER_SET}}\n": "the variable FEDTEST_NEVER_SET",
    }
    for i, (text, expected) in enumerate(cases.items()):
        bad = tmp_path / f"bad-{i}.yaml"
        bad.write_text(text)
        code, _, err = await run_cli("check", str(bad), env=env)
        assert code == 2 and str(bad) in err and expected in err, err


async def test_a_bad_peer_file_stops_the_trace_service(tmp_path: Path) -> None:
    from agentmesh.libs.config import MeshSettings
    from agentmesh.libs.peers import PeerConfigError
    from agentmesh.services.trace import server as trace_server

    bad = tmp_path / "peers.yaml"
    for text, expected in (
        ("peer: {t: {url: 'http://t'}}\n", "unknown key 'peer'"),
        ("trace_store: {type: database, url: 'mongodb://db/traces'}\n", "trace_store.url"),
        (
            "peers: {t: {url: 'http://t', credential: FEDTEST_NEVER_SET_KEY}}\n",
            "FEDTEST_NEVER_SET_KEY is not set",
        ),
    ):
        bad.write_text(text)
        settings = MeshSettings(data_dir=tmp_path, peers=str(bad), mesh_secret="x" * 32)
        with pytest.raises(PeerConfigError) as refused:
            await trace_server.build(settings)
        assert str(refused.value).startswith(str(bad)) and expected in str(refused.value)
