"""The processes' logs as an operator reads them: JSON lines when stderr is not a terminal (a file, a
pipe, a container's log), readable text on a terminal, never a colour code; uvicorn's lines (its
start, its access log) and Python's warnings through the same formatter."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.mesh import Ports, wait_until


@pytest.fixture
def ports() -> Iterator[Ports]:
    held = Ports()
    yield held
    held.release()


def process_env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTMESH_", "GRPC_"))}
    env.update(AGENTMESH_DATA_DIR=str(tmp), AGENTMESH_SHUTDOWN_GRACE_S="1", **extra)
    return env


async def run_until_up(args: list[str], env: dict[str, str], url: str, stderr: Any) -> None:
    """Starts `agentmesh ARGS`, waits until `url` answers 200, then stops it with SIGTERM."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentmesh.cli",
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=stderr,
    )
    try:

        async def answers() -> bool:
            try:
                async with httpx.AsyncClient(timeout=1) as http:
                    return (await http.get(url)).status_code == 200
            except httpx.HTTPError:
                return False

        await wait_until(answers, 30, f"{url} to answer")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)


def json_lines(text: str) -> list[dict[str, Any]]:
    assert "\x1b" not in text and "\\u001b" not in text, "a colour code"
    lines = text.splitlines()
    assert lines, "no log lines"
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
    return out


async def test_a_gateway_logs_json_lines_with_uvicorns_among_them(tmp_path: Path, ports: Ports) -> None:
    port = ports.take()
    env = process_env(
        tmp_path,
        AGENTMESH_GATEWAY_PORT=str(port),
        AGENTMESH_A2A__GRPC_LISTEN="",
        AGENTMESH_GATEWAY_ACCESS_LOG="true",
    )
    log = tmp_path / "gateway.log"
    with log.open("wb") as stderr:  # a file, not a terminal: JSON without being asked
        await run_until_up(["serve", "gateway"], env, f"http://127.0.0.1:{port}/healthz", stderr)
    lines = json_lines(log.read_text())
    assert {x["service"] for x in lines} == {"gateway"}
    started = next(x for x in lines if x["msg"].startswith("Started server process"))
    assert started["logger"] == "uvicorn.error" and "color_message" not in started
    access = [x for x in lines if x["logger"] == "uvicorn.access"]
    assert any((x["method"], x["path"], x["status"]) == ("GET", "/healthz", 200) for x in access), access
    assert any(x["logger"] == "py.warnings" for x in lines)  # uvicorn's DeprecationWarning, formatted
    assert any(x["msg"] == "Shutting down" for x in lines)


async def test_the_model_server_logs_json_to_a_pipe_and_text_to_a_terminal(
    tmp_path: Path, ports: Ports
) -> None:
    port = ports.take()
    env = process_env(tmp_path)
    url = f"http://127.0.0.1:{port}/v1/models"
    args = ["mock-llm", "--port", str(port)]
    log = tmp_path / "mock.log"
    with log.open("wb") as stderr:
        await run_until_up(args, env, url, stderr)
    lines = json_lines(log.read_text())
    assert any(x["logger"] == "uvicorn.error" and x["service"] == "mock-llm" for x in lines)

    controller, terminal = pty.openpty()
    try:
        await run_until_up(args, env, url, terminal)
        os.close(terminal)
        terminal = -1
        text = read_all(controller)
    finally:
        if terminal >= 0:
            os.close(terminal)
        os.close(controller)
    assert "\x1b" not in text
    lines_ = [line for line in text.splitlines() if line.strip()]
    assert lines_ and not any(line.startswith("{") for line in lines_), text
    assert any(" mock-llm INFO uvicorn.error: Started server process [" in line for line in lines_), text


def read_all(fd: int) -> str:
    """What a terminal's other end holds (the writer is gone)."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other end is closed and everything was read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")
