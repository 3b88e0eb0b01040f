"""OpenTelemetry across every hop, on real processes: each service runs as its own process
(`agentmesh serve`) with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP/gRPC receiver in this test, so
the spans arrive over the wire tagged by the process that made them (`service.name`). A browser's
request with a W3C `traceparent` runs one turn with an agent-invoke callee and a delegate_parallel
subagent: every span of it is in the browser's trace, from all five processes, and every span's parent
is a span of that trace (the gateway's first one: the browser's). The turn, run, tool-call and
child-run spans nest as the calls do, the model calls are spans of the runs, and the JSON log lines
carry the trace id. A turn without a `traceparent` starts a trace of its own."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from tests.mesh import (
    BACKENDS,
    TREE_RULE,
    ProcessMesh,
    sse_events,
    wait_until,
)

FIVE = {f"agentmesh-{s}" for s in ("gateway", "orchestrator", "agent-runtime", "trace", "stream")}
RULES: dict[str, Any] = {
    "rules": [
        TREE_RULE,
        {"system": r"\[general\]", "after_tool": True, "text": "all done"},
        {"system": r"\[general\]", "text": "hello"},
        {"system": r"\[coder\]", "text": "callee reply"},
        {"system": r"\[helper\]", "text": "subagent reply"},
    ]
}


@dataclass
class Span:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)


class Receiver(otlp_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver: keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    async def Export(
        self, request: otlp.ExportTraceServiceRequest, context: grpc.aio.ServicerContext
    ) -> otlp.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            resource = {a.key: a.value.string_value for a in rs.resource.attributes}
            for scope in rs.scope_spans:
                for s in scope.spans:
                    attrs = {a.key: _value(a.value) for a in s.attributes}
                    self.spans.append(
                        Span(
                            resource.get("service.name", ""),
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex(),
                            s.name,
                            s.kind,
                            attrs,
                        )
                    )
        return otlp.ExportTraceServiceResponse()

    def of(self, trace_id: str) -> list[Span]:
        return [s for s in self.spans if s.trace_id == trace_id]


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which else None


pytestmark = pytest.mark.mesh(backends=BACKENDS, scope="function", rules=RULES)


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[Receiver, int]]:
    """An OTLP/gRPC receiver in this test, and its port."""
    receiver = Receiver()
    server = grpc.aio.server()
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield receiver, port
    finally:
        await server.stop(None)


@pytest.fixture
def mesh_options(receiver: tuple[Receiver, int]) -> dict[str, Any]:
    """Every process exports its spans to the receiver."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver[1]}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within a tenth of a second
        "AGENTMESH_LOG_JSON": "true",
    }
    return {"extra_env": env}


@pytest.fixture
def traced(process_mesh: ProcessMesh, receiver: tuple[Receiver, int]) -> tuple[ProcessMesh, Receiver]:
    return process_mesh, receiver[0]


async def turn(mesh: ProcessMesh, message: str, traceparent: str = "") -> list[dict[str, Any]]:
    headers = {"traceparent": traceparent} if traceparent else {}
    async with (
        mesh.http() as http,
        http.stream(
            "POST", "/api/chat", json={"agent": "general", "message": message}, headers=headers
        ) as resp,
    ):
        assert resp.status_code == 200, await resp.aread()
        return [e async for e in sse_events(resp)]


def ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    out = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        out.append(span)
    return out


async def test_one_turn_is_one_trace_across_the_five_processes(traced: tuple[ProcessMesh, Receiver]) -> None:
    mesh, receiver = traced
    trace_id, browser_span = secrets.token_hex(16), secrets.token_hex(8)
    events = await turn(mesh, "tree of calls", f"00-{trace_id}-{browser_span}-01")
    assert events[-1]["type"] == "done", events[-3:]

    def complete() -> bool:
        """Every process's spans are in, and every span's parent (the gateway's root ends last)."""
        spans = receiver.of(trace_id)
        ids = {s.span_id for s in spans} | {browser_span}
        names = [s.name for s in spans]
        return (
            {s.service for s in spans} == FIVE
            and names.count("turn") == 3
            and "POST /api/chat" in names
            and all(s.parent_id in ids for s in spans)
        )

    await wait_until(complete, 15, "the turn's spans from the five processes, each with its parent")
    spans = receiver.of(trace_id)
    by_id = {s.span_id: s for s in spans}

    # One connected trace: the gateway's request span is the browser's child; every other span's parent
    # is in the trace.
    roots = [s for s in spans if s.parent_id == browser_span]
    assert [(r.service, r.name) for r in roots] == [("agentmesh-gateway", "POST /api/chat")]
    dangling = [
        (s.service, s.name) for s in spans if s.parent_id not in by_id and s.parent_id != browser_span
    ]
    assert not dangling, dangling
    root = roots[0]
    assert all(root in ancestors(s, by_id) for s in spans if s is not root)

    # Each gRPC server span's parent is the caller's client span of the same method, in another process.
    servers = [s for s in spans if s.kind == 2 and s.service != "agentmesh-gateway"]  # SPAN_KIND_SERVER
    assert {s.service for s in servers} == FIVE - {"agentmesh-gateway"}
    for s in servers:
        caller = by_id[s.parent_id]
        assert caller.kind == 3 and caller.name == s.name and caller.service != s.service, (s, caller)

    # Turns, runs, tool calls and child runs nest as the calls do.
    turns = [s for s in spans if s.name == "turn"]
    chat_turn = next(t for t in turns if t.attributes["agentmesh.agent"] == "general")
    assert {t.attributes["agentmesh.agent"] for t in turns} == {"general", "coder", "helper"}
    for child in (t for t in turns if t is not chat_turn):
        chain = [a.name for a in ancestors(child, by_id)]
        invoke = child.attributes["agentmesh.agent"] == "coder"
        tool = "tool agent-invoke" if invoke else "tool delegate_parallel"
        assert chain.index(tool) < chain.index("run general") < chain.index("turn")
        if invoke:
            assert chain.index("agent-invoke coder") < chain.index(tool)
        # the orchestrator's server span of the call that asked for it
        assert by_id[child.parent_id].name.endswith("RunTurn" if invoke else "RunSubagents")
    runs = [s for s in spans if s.name.startswith("run ")]
    assert sorted(r.name for r in runs) == ["run coder", "run general", "run helper"]
    for run in runs:  # each run is in its turn, through RunAgent
        assert [a.name for a in ancestors(run, by_id)][:2][-1].endswith("RunAgent")
    # The model calls are client spans of the runs.
    model = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert len(model) == 4  # the supervisor twice, the callee, the subagent
    for call in model:
        assert call.kind == 3 and by_id[call.parent_id].name.startswith("run "), call
        assert call.attributes["gen_ai.usage.output_tokens"] > 0

    # JSON log lines carry the trace id (the turn engine logs each turn's end).
    lines = [
        json.loads(line)
        for line in (Path(mesh.env["AGENTMESH_DATA_DIR"]) / "orchestrator.log").read_text().splitlines()
        if line.startswith("{")
    ]
    ended = [line for line in lines if line["msg"] == "turn ended"]
    assert len(ended) == 3 and {line.get("trace_id") for line in ended} == {trace_id}

    # A request without traceparent starts a trace of its own, with its turn in it (not in the first).
    await turn(mesh, "hello")

    def new_trace() -> list[Span]:
        for root in (s for s in receiver.spans if s.name == "POST /api/chat" and s.trace_id != trace_id):
            if any(s.name == "turn" for s in receiver.of(root.trace_id)):
                return [root]
        return []

    (root,) = await wait_until(new_trace, 10, "a new trace with its turn")
    assert root.parent_id == ""
    assert [s.name for s in receiver.of(trace_id)].count("turn") == 3
