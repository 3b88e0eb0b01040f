"""`agentmesh up` owns its ports: it checks every one before it starts anything and stops with one
line naming the busy ones (exit 1), and `--port-base N` moves the whole mesh, so two meshes run side
by side on one machine. The bundled model's pace (`--tokens-per-second`) and another model
(`--model-url`) are flags of `up` too."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentmesh.libs.rpc import wait_serving
from agentmesh.mock_llm import MockLLM
from agentmesh.ports import OFFSETS, SPAN
from tests.mesh import Ports, log_file, sse_events


@dataclass
class Up:
    """A running `agentmesh up`."""

    proc: asyncio.subprocess.Process
    url: str
    key: str
    data_dir: Path

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()


def up_env(data_dir: Path) -> dict[str, str]:
    """The environment of a user's shell: nothing of the mesh's own but its data directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTMESH_")}
    env.update(AGENTMESH_DATA_DIR=str(data_dir), AGENTMESH_SHUTDOWN_GRACE_S="2")
    return env


async def start_up(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> Up:
    """`agentmesh up ARGS` as a user starts it; returns once it printed its URL and key."""
    log = log_file(data_dir / "up.log")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", "up", *args, env=env or up_env(data_dir),
        stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
    )  # fmt: skip
    log.close()
    url = key = ""
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(90):
            while not key:
                line = (await proc.stdout.readline()).decode()
                assert line, f"agentmesh up exited: {tail(data_dir / 'up.log')}"
                if "agentmesh is up at" in line:
                    url = line.split("at", 1)[1].strip()
                if "development API key" in line:
                    key = line.rsplit(":", 1)[1].strip()
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        raise
    return Up(proc, url, key, data_dir)


def tail(path: Path) -> str:
    return path.read_text()[-2000:]


async def run_up(data_dir: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """`agentmesh up ARGS` expected to stop by itself: (exit code, stderr, seconds it took)."""
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentmesh.cli", "up", *args, env=env or up_env(data_dir),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, err.decode(), time.monotonic() - started


async def turn(up: Up, message: str) -> list[dict[str, Any]]:
    """A turn of the general assistant; each event carries `_t` (when it came)."""
    headers = {"Authorization": f"Bearer {up.key}"}
    async with (
        httpx.AsyncClient(base_url=up.url, headers=headers, timeout=60) as http,
        http.stream("POST", "/api/chat", json={"agent": "general", "message": message}) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        events = []
        async for event in sse_events(resp):
            event["_t"] = time.monotonic()
            events.append(event)
    assert events[-1]["type"] == "done", events[-3:]
    return events


@pytest.fixture(scope="module")
def ports() -> Iterator[Ports]:
    held = Ports()
    yield held
    held.release()


@pytest.fixture(scope="module")
async def first(ports: Ports, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    """A mesh on a port base of its own, its bundled model slowed."""
    base = ports.take_range(SPAN)
    up = await start_up(
        tmp_path_factory.mktemp("first"), "--port-base", str(base), "--tokens-per-second", "40"
    )
    yield up
    await up.stop()


def base_of(up: Up) -> int:
    return int(up.url.rsplit(":", 1)[1])


async def test_a_second_up_on_busy_ports_fails_fast_and_names_them(first: Up, tmp_path: Path) -> None:
    base = base_of(first)
    code, err, took = await run_up(tmp_path / "second", "--port-base", str(base))
    assert code == 1, err
    assert f"port {base + OFFSETS['trace']} (trace) is in use" in err
    assert f"port {base} (gateway) is in use" in err and f"port {base + 6} (model) is in use" in err
    assert err.startswith("agentmesh up: ") and "Traceback" not in err
    assert "--port-base" in err.splitlines()[1]  # the hint: move this one
    assert len(err.splitlines()) == 2
    assert took < 20, "nothing was started, nothing waited on"
    assert not (tmp_path / "second").exists(), "nothing was written either"
    async with httpx.AsyncClient() as http:  # the first mesh is untouched
        assert (await http.get(f"{first.url}/healthz")).status_code == 200


async def test_up_and_its_children_log_json_lines_to_a_file(first: Up) -> None:
    """`up`'s stderr is a file here, not a terminal: every line of every child is JSON, uncoloured."""
    text = log_text(first.data_dir / "up.log")
    assert "\x1b" not in text and "\\u001b" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    assert {x["service"] for x in lines} >= {
        "mock-llm",
        "trace",
        "stream",
        "agent-runtime",
        "orchestrator",
        "gateway",
    }


def log_text(path: Path) -> str:
    return path.read_text()


async def test_one_busy_port_of_the_default_layout(tmp_path: Path, ports: Ports) -> None:
    """Without --port-base the ports come from the settings; one taken by another program is named."""
    env = up_env(tmp_path)
    names = {"GATEWAY_PORT": "", "ADDRESSES__ORCHESTRATOR": "", "ADDRESSES__AGENT_RUNTIME": "",
             "ADDRESSES__TRACE": "", "ADDRESSES__STREAM": "", "A2A__GRPC_LISTEN": ""}  # fmt: skip
    for name in names:
        port = ports.take()
        env[f"AGENTMESH_{name}"] = str(port) if name == "GATEWAY_PORT" else f"127.0.0.1:{port}"
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        busy = squatter.getsockname()[1]
        env["AGENTMESH_ADDRESSES__TRACE"] = f"127.0.0.1:{busy}"
        code, err, _ = await run_up(tmp_path, "--mock-port", str(ports.take()), env=env)
    assert code == 1
    assert err.splitlines()[0] == f"agentmesh up: port {busy} (trace) is in use"


async def test_port_base_runs_two_meshes_side_by_side(first: Up, ports: Ports) -> None:
    """The one flag is enough: the second mesh shares the first's data directory (its SQLite
    database, mesh secret and development key), as meshes of one organisation share a database."""
    base = ports.take_range(SPAN)
    second = await start_up(first.data_dir, "--port-base", str(base))
    try:
        assert second.url == f"http://127.0.0.1:{base}"
        for service in ("orchestrator", "agent-runtime", "trace", "stream"):
            await wait_serving(f"127.0.0.1:{base + OFFSETS[service]}", timeout_s=5)
        async with httpx.AsyncClient() as http:
            models = await http.get(f"http://127.0.0.1:{base + OFFSETS['model']}/v1/models")
            assert models.status_code == 200
        with socket.create_connection(("127.0.0.1", base + OFFSETS["a2a-grpc"]), timeout=5):
            pass
        # Both answer the demo at once.
        one, two = await asyncio.gather(
            turn(first, "ask the coding assistant to write fizzbuzz"),
            turn(second, "split this into subtasks: a todo app"),
        )
        assert "def fizzbuzz" in "".join(e.get("textDelta", "") for e in one)
        assert any(e["type"] == "subagent-done" for e in two)
        assert first.key == second.key  # one database: the development key works on both
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {second.key}"}) as http:
            listed = (await http.get(f"{second.url}/api/sessions")).json()["sessions"]
        assert one[0]["traceId"] in {s["id"] for s in listed}  # and each lists the other's sessions
        # The first mesh's model is slowed (--tokens-per-second 40): its answer streams, it does not
        # arrive in one piece at the end of the turn.
        texts = [e["_t"] for e in one if e["type"] == "text-delta"]
        assert len(texts) > 20 and one[-1]["_t"] - texts[0] > 0.5
    finally:
        await second.stop()
    assert second.proc.returncode == 0


async def test_model_url_points_the_mesh_at_another_model(ports: Ports, tmp_path: Path) -> None:
    """`--model-url`: no bundled model is started; the runtime calls the given endpoint."""
    model = MockLLM({"rules": [], "default": {"text": "from the other model"}})
    await model.start()
    base = ports.take_range(SPAN)
    up = await start_up(tmp_path, "--port-base", str(base), "--model-url", model.base_url)
    try:
        events = await turn(up, "hello")
        assert "".join(e.get("textDelta", "") for e in events) == "from the other model"
        assert model.requests(), "the mesh called the given model"
        with pytest.raises(httpx.ConnectError):  # and nothing listens where the bundled one would
            async with httpx.AsyncClient() as http:
                await http.get(f"http://127.0.0.1:{base + OFFSETS['model']}/v1/models")
    finally:
        await up.stop()
        await model.stop()


async def test_flags_that_do_not_go_together(tmp_path: Path) -> None:
    code, err, _ = await run_up(tmp_path, "--model-url", "http://x/v1", "--tokens-per-second", "5")
    assert code == 2 and "--tokens-per-second" in err.splitlines()[-1]
    code, err, _ = await run_up(tmp_path, "--port-base", "65530")
    assert code == 2 and "--port-base" in err.splitlines()[-1]
