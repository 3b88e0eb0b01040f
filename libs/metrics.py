"""Prometheus metrics of the gRPC services: the series every server has (its RPCs, counted by the server
interceptor in libs/rpc.py), the series of each kind of work (stream buffers, agent runs and the model,
trace queries, the reaper), and the small HTTP server that serves them at GET /metrics.

Each server has its own registry (several services share one process in the tests), and each component
registers its series on the registry it is given; a component given none gets a private one, counted
but never served. Every served registry has the process's standard series too (`process_series`). The
gateway serves its own at /metrics on its HTTP port, or on an address of its own (gateway/metrics.py).
Series names are the contract of deploy/grafana/agentmesh.json (tests/e2e/deploy checks each panel's).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from agentmesh.libs import aio

log = logging.getLogger(__name__)

# Seconds: from a millisecond lookup to a ten-minute turn.
LATENCY_BUCKETS = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
QUERY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
TPS_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 200, 350, 500, 1000, 5000)


def registry_or_new(registry: CollectorRegistry | None) -> CollectorRegistry:
    return registry if registry is not None else CollectorRegistry()


def process_series(registry: CollectorRegistry) -> CollectorRegistry:
    """The standard series of the process on a served registry, as prometheus_client's default registry
    has them: CPU, memory, open files and start time (`process_*`, from /proc), the interpreter
    (`python_info`) and its garbage collector (`python_gc_*`, and how many objects it no longer walks:
    libs/aio.py's `settle_heap`). Once per registry."""
    try:
        ProcessCollector(registry=registry)
    except ValueError:  # already there (a registry served twice)
        return registry
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    frozen = Gauge(
        "agentmesh_gc_frozen_objects",
        "Objects the garbage collector no longer walks: what the process built before it served",
        registry=registry,
    )
    frozen.set_function(aio.frozen_objects)
    return registry


class RpcMetrics:
    """What every gRPC server counts, by full service name and method (health and reflection excepted)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        labels = ["grpc_service", "grpc_method", "grpc_type"]
        self.started = Counter("agentmesh_grpc_server_started", "RPCs started", labels, registry=r)
        self.handled = Counter(
            "agentmesh_grpc_server_handled",
            "RPCs completed, by status code",
            [*labels, "grpc_code"],
            registry=r,
        )
        self.seconds = Histogram(
            "agentmesh_grpc_server_handling_seconds",
            "Time from an RPC's start to its end (a stream's whole life)",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            "agentmesh_grpc_server_in_flight",
            "RPCs being served now (open streams included)",
            labels,
            registry=r,
        )


class StreamMetrics:
    """The stream backends: buffers open, events appended, subscribers, events merged by coalescing,
    closed buffers held and evicted (memory)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        self.buffers_open = Gauge(
            "agentmesh_stream_buffers_open",
            "Open buffers (memory: this process's; Redis: every replica's, from the lease set)",
            registry=r,
        )
        self.appended = Counter(
            "agentmesh_stream_events_appended", "Events appended, by key kind", ["kind"], registry=r
        )
        self._appended: dict[str, Any] = {}
        self.subscribers = Gauge("agentmesh_stream_subscribers", "Subscriptions being served", registry=r)
        self.coalesced = Counter(
            "agentmesh_stream_events_coalesced",
            "Text deltas merged into a neighbour before they were sent to a subscriber",
            registry=r,
        )
        self.interrupted = Counter(
            "agentmesh_stream_buffers_interrupted",
            "Open buffers ended with `interrupted` because their writer stopped renewing the lease",
            registry=r,
        )
        # The memory backend's closed buffers: held until their TTL within two caps, the oldest evicted.
        self.closed_buffers = Gauge(
            "agentmesh_stream_closed_buffers", "Closed buffers held in memory (memory backend)", registry=r
        )
        self.closed_bytes = Gauge(
            "agentmesh_stream_closed_bytes",
            "The serialized size of the events of the closed buffers held in memory (memory backend)",
            registry=r,
        )
        self.evicted = Counter(
            "agentmesh_stream_buffers_evicted",
            "Closed buffers dropped before their TTL, oldest close first, by the cap that was passed "
            "(buffers: AGENTMESH_STREAM__MAX_CLOSED_BUFFERS, bytes: AGENTMESH_STREAM__MAX_CLOSED_BYTES)",
            ["cap"],
            registry=r,
        )
        for cap in ("buffers", "bytes"):
            self.evicted.labels(cap)  # at zero from the start
        self.evicted_bytes = Counter(
            "agentmesh_stream_evicted_bytes",
            "The serialized size of the events of the closed buffers evicted",
            registry=r,
        )

    def appended_to(self, key: str, count: int) -> None:
        if count:
            kind = key.split(":", 1)[0]
            child = self._appended.get(kind)
            if child is None:  # labels() takes a lock and builds a tuple: once per kind, not per append
                child = self._appended[kind] = self.appended.labels(kind)
            child.inc(count)


class RuntimeMetrics:
    """Agent runs and the model calls inside them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        self.runs = Counter(
            "agentmesh_runtime_runs", "Agent runs ended, by role and outcome", ["role", "outcome"], registry=r
        )
        self.running = Gauge("agentmesh_runtime_runs_in_progress", "Agent runs in progress", registry=r)
        self.tool_calls = Counter(
            "agentmesh_runtime_tool_calls", "Tool calls, by tool and result", ["tool", "ok"], registry=r
        )
        self.ttft = Histogram(
            "agentmesh_model_time_to_first_token_seconds",
            "Model request sent -> first streamed token (text or reasoning)",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.tokens_per_second = Histogram(
            "agentmesh_model_tokens_per_second",
            "Output tokens per second of a model call, after its first token",
            ["model"],
            buckets=TPS_BUCKETS,
            registry=r,
        )
        self.model_calls = Counter(
            "agentmesh_model_calls", "Model calls, by model and outcome", ["model", "outcome"], registry=r
        )
        self.tokens = Counter(
            "agentmesh_model_tokens",
            "Tokens the model reported, by direction",
            ["model", "direction"],
            registry=r,
        )


class TraceStoreMetrics:
    """The trace database: every statement's latency, by operation."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        self.query_seconds = Histogram(
            "agentmesh_trace_query_seconds",
            "Time of one SQL statement of the trace store, by operation",
            ["operation"],
            buckets=QUERY_BUCKETS,
            registry=r,
        )


class PeerMetrics:
    """Calls to peer meshes (libs/peer_http.py) and reads of peers' traces (the trace service's cache)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        self.requests = Counter(
            "agentmesh_peer_requests",
            "HTTP requests to peer meshes, by peer, method and outcome (ok, or the error's code)",
            ["peer", "method", "outcome"],
            registry=r,
        )
        self.seconds = Histogram(
            "agentmesh_peer_request_seconds",
            "Time of one HTTP request to a peer mesh (a streamed answer: until its head)",
            ["peer", "method"],
            buckets=QUERY_BUCKETS,
            registry=r,
        )
        self.up = Gauge(
            "agentmesh_peer_up",
            "1 while a peer counts as answering, 0 while it is marked down (a probe looks for it)",
            ["peer"],
            registry=r,
        )
        self.trace_reads = Counter(
            "agentmesh_peer_trace_reads",
            "Reads of peers' traces, by peer and source (fresh: synced; stale: the cache, the peer down)",
            ["peer", "source"],
            registry=r,
        )


class OrchestratorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = registry_or_new(registry)
        self.turns = Counter(
            "agentmesh_orchestrator_turns",
            "Turns ended, by outcome (ok or an error code)",
            ["outcome"],
            registry=r,
        )
        self.refused = Counter(
            "agentmesh_orchestrator_turns_refused",
            "Turns refused because the replica ran AGENTMESH_MAX_TURNS of them (HTTP 429)",
            registry=r,
        )
        self.running = Gauge(
            "agentmesh_orchestrator_entry_turns",
            "Chat and A2A turns running on this replica (what AGENTMESH_MAX_TURNS bounds)",
            registry=r,
        )
        self.early_runs = Counter(
            "agentmesh_orchestrator_early_runs",
            "New chats whose run started before their agent's read ended (docs/design/turns.md), by "
            "outcome: kept, dropped (the agent had changed), failed (the turn did not begin)",
            ["outcome"],
            registry=r,
        )
        self.reaped = Counter(
            "agentmesh_orchestrator_reaped_rows", "Orphaned rows settled by the reaper", ["kind"], registry=r
        )
        for kind in ("message", "task", "subagent"):
            self.reaped.labels(kind)  # at zero from the start: a dashboard plots nothing reaped yet


Refresh = Callable[[], Awaitable[None]]


def metrics_app(registry: CollectorRegistry, refresh: list[Refresh]) -> Callable[..., Awaitable[None]]:
    """A bare ASGI app: GET /metrics runs the refresh hooks (each bounded: a slow backend must not
    hang a scrape), then renders the registry; anything else is 404."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/metrics" or scope["method"] not in ("GET", "HEAD"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"not found\n"})
            return
        for hook in refresh:
            try:
                await asyncio.wait_for(hook(), 2.0)
            except Exception as exc:  # a gauge that could not be refreshed keeps its last value
                log.debug("metrics refresh failed: %s", exc)
        body = generate_latest(registry)
        headers = [(b"content-type", CONTENT_TYPE_LATEST.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})

    return app


class MetricsServer:
    """GET /metrics on host:port (port 0: a free one, then `port`), in the service's own event loop."""

    def __init__(self, address: str, registry: CollectorRegistry, refresh: list[Refresh] | None = None):
        self.host, _, port = address.rpartition(":")
        self.requested_port = int(port)
        self.registry = registry
        self.refresh = refresh if refresh is not None else []
        self.port = 0
        self._server: Any = None

    async def start(self) -> None:
        from agentmesh.libs import embedded_http

        self._server = await embedded_http.serve(
            metrics_app(self.registry, self.refresh),
            self.host.strip("[]") or "0.0.0.0",
            self.requested_port,
            lifespan="off",
        )
        self.port = self._server.port
        log.info("metrics serving", extra={"address": f"{self.host}:{self.port}"})

    async def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.stop(2.0)
            self._server = None
