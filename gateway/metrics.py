"""GET /metrics: Prometheus text for the gateway (requests, latency, live streams, and the process's
standard series), on the public HTTP port or, with AGENTMESH_GATEWAY_METRICS_LISTEN, only on an
address of its own (gateway/app.py), so the public port does not expose them."""

from __future__ import annotations

import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentmesh.libs.metrics import process_series


class Metrics:
    """One registry per app, so several gateways in one process (tests) do not share counters."""

    def __init__(self) -> None:
        self.registry = process_series(CollectorRegistry())
        self.requests = Counter(
            "agentmesh_http_requests",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "agentmesh_http_request_seconds",
            "Time to the response head, by route",
            ["method", "route"],
            registry=self.registry,
        )
        self.streams = Gauge(
            "agentmesh_http_open_streams", "Open SSE responses and WebSockets", registry=self.registry
        )

    def render(self) -> Response:
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    """Counts every HTTP request under its route template (never the raw path: ids would explode)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    @staticmethod
    def _route(scope: Scope) -> str:
        """The matched route's template; routing records it in the (shared) scope."""
        route = scope.get("route")
        return getattr(route, "path", None) or "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "WS")
        started = time.perf_counter()
        status = "0"
        streaming = False

        async def observe(message: Message) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = str(message["status"])
                self.metrics.latency.labels(method, self._route(scope)).observe(time.perf_counter() - started)
                headers = dict(message.get("headers") or [])
                if headers.get(b"content-type", b"").startswith(b"text/event-stream"):
                    streaming = True
                    self.metrics.streams.inc()
            elif message["type"] == "websocket.accept":
                status, streaming = "101", True
                self.metrics.streams.inc()
            await send(message)

        try:
            await self.app(scope, receive, observe)
        finally:
            if streaming:
                self.metrics.streams.dec()
            self.metrics.requests.labels(method, self._route(scope), status).inc()


async def metrics_endpoint(request: Request) -> Response:
    return request.app.state.metrics.render()  # type: ignore[no-any-return]
