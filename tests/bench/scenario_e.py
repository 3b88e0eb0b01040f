"""Scenario E -- HOOK, NOT IMPLEMENTED YET: messages appended per second through the trace service
on PostgreSQL.

TODO(trace/proto restructuring): this needs the trace service's gRPC surface (the generated
`agentmesh.v1` stubs and the request messages for creating a session and appending messages),
which is being restructured right now, so the bench does not touch it yet. Whoever lands the new
trace API fills in `run` below; nothing else in the harness has to change:

- `run(ctx)` gets a `Context`: `database_url` (PostgreSQL, from --e-database-url or
  $TEST_DATABASE_URL; start the trace service on it with `agentmesh serve trace` and
  AGENTMESH_DATABASE_URL, on a free port, in `ctx.work`), `seconds` (how long to append),
  `concurrency` (parallel writers) and `work` (a scratch directory);
- it returns a dict with at least `messages_per_s` (appended and acknowledged), and ideally
  `append_latency_ms` ({p50, p99}, use scenarios.dist), `errors` ({code: count}) and `cpu`
  (CPU seconds of the trace process per 1,000 messages, procs.Proc.cpu gives them);
- set `IMPLEMENTED = True`. Until then `make bench` reports E as skipped with `SKIP_REASON`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

IMPLEMENTED = False
SKIP_REASON = (
    "not implemented yet: needs the trace service's gRPC API, which is being restructured "
    "(hook: tests/bench/scenario_e.py)"
)


@dataclass
class Context:
    database_url: str
    seconds: float
    concurrency: int
    work: Path


async def run(ctx: Context) -> dict[str, Any]:
    """Messages appended per second through the trace service on PostgreSQL (see the module doc)."""
    raise NotImplementedError(SKIP_REASON)
