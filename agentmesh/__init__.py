"""agentmesh. Every process of the mesh starts here (`agentmesh ...`, `python -m agentmesh.cli`), so
this runs before gRPC is imported, which is when gRPC reads its experiments.

gRPC's transport: its classic one (polled by the asyncio poller thread itself), not the EventEngine
that grpcio turns on by default since 1.80 (I/O on an engine thread pool, one more thread hand-off per
RPC event). With the classic transport a one-token turn costs the mesh's five processes 9-13 % less
CPU on the 2-core bench machine, its first delta 1-1.5 ms sooner (README, Benchmarks, step 32). A
GRPC_EXPERIMENTS set in the environment is kept as it is (set it empty for grpcio's own defaults).
"""

import os

GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"
os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
