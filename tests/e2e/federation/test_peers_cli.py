"""`agentmesh peers list|check`: the registry without its secrets; whether each peer answers, in time."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

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
