"""W3C trace context across A2A hops (A2A issue #2103): a traceparent that an A2A client sends in the
message's metadata continues the trace through the turn it starts here, and agent-invoke of a remote
agent sends the caller's trace as a `traceparent` header and in the message's metadata. Tracing is
process-wide, so this runs in a process of its own (tests/e2e/a2a/trace_probe.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from tests.e2e.a2a.trace_probe import INBOUND


async def test_traceparent_is_sent_and_accepted() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.e2e.a2a.trace_probe",
        cwd=Path(__file__).parents[3],
        stdout=asyncio.subprocess.PIPE,
    )
    stdout, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0
    found = json.loads(stdout.decode().strip().splitlines()[-1])
    assert found["reply"] == "echo: traced"
    inbound = found["inbound_spans"]
    assert any("RunTurn" in name for name in inbound) and any("RunAgent" in name for name in inbound), inbound
    caller = found["caller_trace"]
    assert found["remote_reply"] == "remote says: traced"
    assert [t.split("-")[1] for t in found["metadata"]] == [caller]
    assert found["headers"] and all(t.split("-")[1] == caller for t in found["headers"])
    assert INBOUND.startswith("00-")
