"""The wheel as a user installs it: built from what a clean clone holds (no generated code, no
node_modules, no vendor files), installed into a fresh venv outside the checkout, and run from another
directory: `agentmesh up` serves the UI with its vendor scripts and completes a turn."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.mesh import Ports, log_file, process_env, sse_events

ROOT = Path(__file__).resolve().parents[3]
# A wheel build and a fresh venv's install take minutes on a busy 2-core machine.
pytestmark = pytest.mark.timeout(900)


def _clean_clone(dest: Path) -> Path:
    """The files git tracks (and untracked ones it does not ignore), as a clean clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = _clean_clone(tmp_path_factory.mktemp("clone"))
    assert not (src / "node_modules").exists() and not list(src.glob("agentmesh/*/v1"))
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)],
        check=True, timeout=600,
    )  # fmt: skip
    (built,) = out.glob("agentmesh-*.whl")
    return built


def test_the_wheel_holds_one_import_root_the_generated_code_and_the_vendor_files(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    roots = {n.split("/", 1)[0] for n in names if not n.startswith("agentmesh-")}
    assert roots == {"agentmesh"}, roots
    for needed in (
        "agentmesh/trace/v1/trace_service_pb2.py",
        "agentmesh/trace/v1/trace_service_pb2_grpc.py",
        "agentmesh/trace/v1/message_service_pb2_grpc.py",
        "agentmesh/trace/v1/task_service_pb2_grpc.py",
        "agentmesh/trace/v1/subagent_service_pb2_grpc.py",
        "agentmesh/services/trace/migrations/env.py",
        "agentmesh/services/trace/alembic.ini",
        "agentmesh/gateway/static/index.html",
        "agentmesh/gateway/static/ui/vendor/marked.esm.js",
        "agentmesh/gateway/static/ui/vendor/purify.es.mjs",
        "agentmesh/mock_llm/demo_rules.yaml",
    ):
        assert needed in names, needed
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    runtime = [line for line in requires if "extra ==" not in line]
    assert runtime and not [line for line in runtime if "grpcio-tools" in line]  # to build, not to run


@pytest.fixture
def venv(wheel: Path, tmp_path: Path) -> Path:
    """A fresh venv outside the checkout with the wheel installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: byte-compiling every dependency took two thirds of the install; Python compiles
    # what the mesh imports when it runs.
    pip = [str(venv / "bin/pip"), "install", "-q", "--prefer-binary", "--no-compile"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=900)
    return venv


async def test_the_installed_wheel_runs_the_mesh_from_anywhere(venv: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ports = Ports()
    env = process_env(elsewhere, ports)
    env.pop("PYTHONPATH", None)
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    log = log_file(tmp_path / "up.log")
    proc = await asyncio.create_subprocess_exec(
        str(venv / "bin/agentmesh"), "up", "--mock-port", str(ports.take()),
        cwd=elsewhere, env=env, stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
    )  # fmt: skip
    log.close()
    try:
        url = key = ""
        assert proc.stdout is not None
        async with asyncio.timeout(90):
            while not key:
                line = (await proc.stdout.readline()).decode()
                assert line, f"agentmesh up exited: {(tmp_path / 'up.log').read_text()[-3000:]}"
                if "agentmesh is up at" in line:
                    url = line.split("at", 1)[1].strip()
                if "development API key" in line:
                    key = line.rsplit(":", 1)[1].strip()
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            page = await http.get("/")
            assert page.status_code == 200 and 'src="/ui/app.js"' in page.text
            for script in ("/ui/app.js", "/ui/vendor/marked.esm.js", "/ui/vendor/purify.es.mjs"):
                got = await http.get(script)
                assert got.status_code == 200 and "javascript" in got.headers["content-type"], script
            body = {"agent": "general", "message": "hello"}
            headers = {"Authorization": f"Bearer {key}"}
            async with http.stream("POST", "/api/chat", json=body, headers=headers) as resp:
                assert resp.status_code == 200
                kinds = [event["type"] async for event in sse_events(resp)]
        assert kinds[0] == "start" and "text-delta" in kinds and kinds[-1] == "done", kinds
    finally:
        if proc.returncode is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        ports.release()
