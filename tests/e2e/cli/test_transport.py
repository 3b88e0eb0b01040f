"""gRPC's transport in every process of the mesh: the classic one unless GRPC_EXPERIMENTS says
otherwise (agentmesh/__init__.py). Told apart by what gRPC's `tcp` tracer logs: the classic transport
connects in tcp_client_posix.cc, the EventEngine elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CLASSIC = "tcp_client_posix.cc"


def _connect_log(**env: str) -> str:
    """What gRPC's tcp tracer logs while `agentmesh health` tries a closed loopback port."""
    base = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    proc = subprocess.run(
        [sys.executable, "-m", "agentmesh.cli", "health", "127.0.0.1:1", "--timeout", "2"],
        env={**base, "GRPC_TRACE": "tcp", "GRPC_VERBOSITY": "DEBUG", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 1, proc.stderr  # nothing listens there
    assert "UNAVAILABLE" in proc.stderr
    return proc.stderr


def test_a_process_of_the_mesh_uses_the_classic_transport() -> None:
    assert CLASSIC in _connect_log()


@pytest.mark.parametrize("setting", ["", "event_engine_client"])
def test_grpc_experiments_in_the_environment_win(setting: str) -> None:
    assert CLASSIC not in _connect_log(GRPC_EXPERIMENTS=setting)
