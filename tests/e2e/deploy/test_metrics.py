"""Metrics on every service: after one turn with an agent-invoke callee and two subagents, a scrape of each
service's GET /metrics shows its series moved (gRPC servers, stream buffers, runs and the model, trace
queries, turns); and every panel of the Grafana dashboard plots series the services export. On both
backend pairs (the stream service's buffers-open gauge reads Redis's lease set there)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentmesh.libs.config import MetricsAddresses
from tests.mesh import ANY_PORT, BACKENDS, TEST_CATALOG, Mesh, chat, start_mesh

DASHBOARD = Path(__file__).resolve().parents[3] / "deploy/grafana/agentmesh.json"
RULES: dict[str, Any] = {
    "rules": [
        {
            "system": r"\[general\]",
            "user": "^tree",
            "after_tool": False,
            "tool_calls": [
                {"name": "agent-invoke", "arguments": {"agentSlug": "coder", "input": "callee"}},
                {
                    "name": "delegate_parallel",
                    "arguments": {"tasks": [{"goal": "one", "agentSlug": "helper"}, {"goal": "two"}]},
                },
            ],
        },
        {"system": r"\[general\]", "after_tool": True, "text": "all done " * 10},
        {"system": r"\[coder\]", "text": "callee " * 20},
        {"system": r"\[helper\]", "text": "subagent " * 20},
        {"system": r"\[general\]", "text": "cloned " * 20},
    ]
}

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


EVERY = MetricsAddresses(orchestrator=ANY_PORT, agent_runtime=ANY_PORT, trace=ANY_PORT, stream=ANY_PORT)
pytestmark = pytest.mark.mesh(backends=BACKENDS, rules=RULES, catalog=TEST_CATALOG, metrics=EVERY)


async def scrape(url: str) -> Samples:
    async with httpx.AsyncClient(timeout=10) as http:
        resp = await http.get(url)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    out: Samples = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of every sample of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


async def scrape_all(mesh: Mesh) -> dict[str, Samples]:
    out = {
        name: await scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
        for name, server in mesh.servers.items()
    }
    out["gateway"] = await scrape(f"{mesh.url}/metrics")
    return out


async def test_a_turn_moves_the_series_of_every_service(mesh: Mesh) -> None:
    before = await scrape_all(mesh)
    events = await chat(mesh, "general", "tree of calls")
    assert events[-1]["type"] == "done", events[-3:]
    after = await scrape_all(mesh)

    def moved(service: str, name: str, **labels: str) -> float:
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    handled = "agentmesh_grpc_server_handled_total"
    for service, method in (
        ("orchestrator", "RunTurn"),
        ("orchestrator", "RunSubagents"),
        ("agent-runtime", "RunAgent"),
        ("trace", "BeginTurn"),
        ("trace", "UpdateMessage"),
        ("stream", "CreateStream"),
        ("stream", "CloseStream"),
    ):
        assert moved(service, handled, grpc_method=method, grpc_code="OK") >= 1, (service, method)
        assert moved(service, "agentmesh_grpc_server_handling_seconds_count", grpc_method=method) >= 1
        in_flight = value(after[service], "agentmesh_grpc_server_in_flight", grpc_method=method)
        assert in_flight == 0, (service, method)  # every call of the turn has ended
    assert moved("orchestrator", handled, grpc_method="RunTurn") == 2  # the chat turn and the callee's
    assert moved("orchestrator", handled, grpc_method="RunSubagents") == 1  # the batch of two
    # The runs' writers and the readers of every buffer share long-lived calls: one a process at most.
    for method in ("WriteStreams", "FollowStreams"):
        assert moved("stream", "agentmesh_grpc_server_started_total", grpc_method=method) <= 2, method
        assert value(after["stream"], "agentmesh_grpc_server_in_flight", grpc_method=method) >= 1, method

    for kind in ("trace", "a2a", "subagent"):
        assert moved("stream", "agentmesh_stream_events_appended_total", kind=kind) >= 3, kind
    assert ("agentmesh_stream_buffers_open", frozenset()) in after["stream"]
    assert ("agentmesh_stream_subscribers", frozenset()) in after["stream"]
    assert ("agentmesh_stream_events_coalesced_total", frozenset()) in after["stream"]

    runs = "agentmesh_runtime_runs_total"
    assert moved("agent-runtime", runs, role="supervisor", outcome="ok") == 1
    assert moved("agent-runtime", runs, role="a2a_callee", outcome="ok") == 1
    assert moved("agent-runtime", runs, role="subagent", outcome="ok") == 2
    assert moved("agent-runtime", "agentmesh_runtime_tool_calls_total", tool="agent-invoke", ok="true") == 1
    # The supervisor's two model calls, the callee's and the subagents'.
    assert moved("agent-runtime", "agentmesh_model_time_to_first_token_seconds_count") == 5
    assert moved("agent-runtime", "agentmesh_model_tokens_per_second_count") == 5
    assert moved("agent-runtime", "agentmesh_model_tokens_total", direction="output") > 0

    assert moved("trace", "agentmesh_trace_query_seconds_count", operation="insert") >= 4  # a turn writes
    assert moved("trace", "agentmesh_trace_query_seconds_count", operation="select") >= 1
    assert moved("orchestrator", "agentmesh_orchestrator_turns_total", outcome="ok") == 4
    assert moved("gateway", "agentmesh_http_requests_total", route="/api/chat", status="200") == 1


async def test_child_turns_are_handed_their_agent_and_history(mesh: Mesh) -> None:
    """The callee and the two subagents run in new hidden traces: a new trace has no history to read
    back (each run is handed its input). The orchestrator reads the agent of every turn it runs (the
    supervisor, the callee, the batch's two agents once), and the tools read what they check before
    they ask for a turn (the callee, the preset). The subagents' turns are stored with their rows."""
    await chat(mesh, "general", "a first turn: this user has read the agent before")
    before = await scrape_all(mesh)
    events = await chat(mesh, "general", "tree of reads")
    assert events[-1]["type"] == "done", events[-3:]
    after = await scrape_all(mesh)
    handled = "agentmesh_grpc_server_handled_total"

    def moved(method: str) -> float:
        return value(after["trace"], handled, grpc_method=method) - value(
            before["trace"], handled, grpc_method=method
        )

    assert moved("BeginTurn") == 2  # the supervisor's turn and the callee's
    assert moved("CreateSubagentSessions") == 1  # the two subagents, their hidden traces and turns
    assert moved("ListMessages") == 0
    assert moved("GetAgent") == 6, moved("GetAgent")


async def test_the_metrics_server_answers_only_metrics(mesh: Mesh) -> None:
    port = mesh.servers["trace"].metrics_port
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(f"http://127.0.0.1:{port}/")).status_code == 404
        assert (await http.post(f"http://127.0.0.1:{port}/metrics")).status_code == 404


async def test_every_dashboard_panel_plots_exported_series(mesh: Mesh) -> None:
    await chat(mesh, "general", "tree again")
    exported = {name for samples in (await scrape_all(mesh)).values() for name, _ in samples}
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p.get("type") != "row"]
    assert len(panels) >= 12
    for panel in panels:
        assert panel.get("targets"), panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bagentmesh_[a-z0-9_]+", target["expr"]))
            assert names, (panel["title"], target["expr"])
            missing = names - exported
            assert not missing, (panel["title"], missing)


PROCESS_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_open_fds",
    "process_start_time_seconds",
    "python_info",
    "python_gc_collections_total",
)


async def test_every_process_serves_the_standard_process_series(mesh: Mesh) -> None:
    for service, samples in (await scrape_all(mesh)).items():
        names = {name for name, _ in samples}
        missing = [name for name in PROCESS_SERIES if name not in names]
        assert not missing, (service, missing)
        assert value(samples, "process_resident_memory_bytes") > 0, service


@pytest.fixture(scope="module")
async def private_metrics(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """A gateway whose metrics are on an address of their own (AGENTMESH_GATEWAY_METRICS_LISTEN)."""
    m = await start_mesh(
        tmp_path_factory.mktemp("private-metrics"),
        rules=RULES,
        catalog=TEST_CATALOG,
        gateway_metrics_listen=ANY_PORT,
    )
    yield m
    await m.stop()


async def test_the_gateways_metrics_on_their_own_address(private_metrics: Mesh) -> None:
    mesh = private_metrics
    server = mesh.gateway.config.app.state.metrics_server  # type: ignore[union-attr]
    assert server is not None and server.port
    async with mesh.http() as http:
        public = await http.get("/metrics")
        assert public.status_code == 404 and public.json()["error"]["reason"] == "NOT_FOUND"
        assert (await http.get("/api/sessions")).status_code == 200
    samples = await scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert value(samples, "agentmesh_http_requests_total", route="/api/sessions", status="200") == 1
    assert value(samples, "agentmesh_http_requests_total", route="unmatched", status="404") == 1
    assert "process_cpu_seconds_total" in {name for name, _ in samples}
    async with httpx.AsyncClient(timeout=5) as http:  # that address serves metrics and nothing else
        assert (await http.get(f"http://127.0.0.1:{server.port}/api/sessions")).status_code == 404
