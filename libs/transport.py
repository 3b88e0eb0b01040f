"""gRPC's transport, chosen by each process's `main` before anything imports gRPC (gRPC reads its
experiments when it is first imported).

The classic transport (polled by the asyncio poller thread itself), not the EventEngine that grpcio
turns on by default since 1.80 (I/O on an engine thread pool, one more thread hand-off per RPC
event): on the 2-core benchmark machine a one-token turn costs the mesh's processes 9-13 % less CPU
with it, and its first delta comes 1-1.5 ms sooner (docs/benchmarks.md). A GRPC_EXPERIMENTS set in
the environment is kept as it is (set it empty for grpcio's own defaults).
"""

from __future__ import annotations

import os
import sys

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def use_classic_transport() -> None:
    """Selects the classic transport for this process; call it first thing in `main` (again later: a
    no-op, the choice is made)."""
    if "GRPC_EXPERIMENTS" in os.environ:
        return
    if "grpc" in sys.modules:
        raise RuntimeError("gRPC's transport is chosen before gRPC is imported")
    os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
