"""Run by test_traceparent.py in its own process (tracing is process-wide): a mesh with tracing on and
an in-memory span exporter. Prints what it found as JSON."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from agentmesh.libs import telemetry
from agentmesh.services.agent_runtime.a2a_client import RemoteAgent
from tests.e2e.a2a.clients import sdk_client, text_message, text_of
from tests.e2e.a2a.remote_server import KEY, start_remote
from tests.mesh import Ports, start_mesh

RULES = {"rules": [{"system": r"\[echo\]", "text": "echo: {user}"}], "default": {"text": "x"}}
INBOUND = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def main() -> dict[str, object]:
    exporter = InMemorySpanExporter()
    telemetry.setup("a2a-probe", exporter=exporter)
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        mesh = await start_mesh(Path(tmp), rules=RULES, catalog=Path(__file__).parent / "catalog.yaml")
        try:
            # Accepted: a traceparent that comes only in the message's metadata continues the trace.
            with suppress_instrumentation():  # no traceparent header from this client: only the metadata's
                client = await sdk_client(f"{mesh.url}/a2a/echo", mesh.api_key)
                responses = [
                    r async for r in client.send_message(text_message("traced", traceparent=INBOUND))
                ]
                await client.close()
            out["reply"] = text_of(responses)
            trace_id = INBOUND.split("-")[1]
            out["inbound_spans"] = sorted(
                {
                    s.name
                    for s in exporter.get_finished_spans()
                    if format(s.context.trace_id, "032x") == trace_id
                }
            )
            # Sent: a call to a remote agent carries the caller's trace as a header and in the metadata.
            ports = Ports()
            remote = await start_remote(ports.take())
            with telemetry.span("caller") as span:
                own = format(span.get_span_context().trace_id, "032x")
                reply = await RemoteAgent(remote.url, KEY, timeout_s=10).call("hello traced")
            out["remote_reply"] = reply.text
            out["caller_trace"] = own
            out["metadata"] = remote.traceparents
            out["headers"] = remote.traceparent_headers
            await remote.server.stop()
            ports.release()
        finally:
            await mesh.stop()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
    sys.stdout.flush()
