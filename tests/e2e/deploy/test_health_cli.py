"""`agentmesh health ADDRESS`: one grpc.health.v1 Check with a deadline, 0 only for SERVING."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from agentmesh.cli import main


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(None)


def test_serving_exits_0(
    server: tuple[str, health.HealthServicer], capsys: pytest.CaptureFixture[str]
) -> None:
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", address]) == 0
    assert capsys.readouterr().out.strip() == f"{address}: SERVING"


def test_not_serving_exits_1(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert main(["health", address]) == 1
    servicer.enter_graceful_shutdown()  # what a service does on SIGTERM
    assert main(["health", address]) == 1


def test_one_service_by_name(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("agentmesh.trace.v1.TraceService", health_pb2.HealthCheckResponse.SERVING)
    assert main(["health", address, "--service", "agentmesh.trace.v1.TraceService"]) == 0
    assert main(["health", address, "--service", "agentmesh.trace.v1.Unknown"]) == 1  # NOT_FOUND


def test_unreachable_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    assert main(["health", f"127.0.0.1:{port}"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_silent_server_hits_the_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    """A peer that accepts the connection and never answers: the deadline ends the check."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        started = time.monotonic()
        assert main(["health", f"127.0.0.1:{listener.getsockname()[1]}", "--timeout", "0.5"]) == 1
        assert time.monotonic() - started < 3
    assert "DEADLINE_EXCEEDED" in capsys.readouterr().err


def test_console_script(server: tuple[str, health.HealthServicer]) -> None:
    """The installed `agentmesh` command, as a container health check runs it."""
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    agentmesh = Path(sys.executable).parent / "agentmesh"
    proc = subprocess.run([str(agentmesh), "health", address], capture_output=True, text=True, timeout=30)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"{address}: SERVING")
