"""OpenTelemetry tracing across every hop: the browser's W3C `traceparent` through the gateway (FastAPI
instrumentation), every gRPC call (the OpenTelemetry aio interceptors, composed with ours in libs/rpc.py:
theirs outermost on a channel, so the `traceparent` they inject travels beside our identity metadata),
the model calls (`model_span()` plus a `traceparent` header: the `openai` client speaks httpx2, which no
instrumentation covers), HTTP calls over httpx (the A2A client, remote traces: httpx instrumentation),
and the spans of our own work (`span()`: the turn, each run, each tool call, each child run). Log lines
carry the current trace id (libs/log.py).

Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set when a process
starts: then spans go over OTLP/gRPC in batches (the exporter reads the usual OTEL_EXPORTER_OTLP_* and
OTEL_BSP_* variables); `service.name` is `agentmesh-<service>` unless OTEL_SERVICE_NAME says otherwise.
Off, nothing is installed: no interceptor, no middleware, no patched client, and `span()` is the API's
no-op span.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

log = logging.getLogger(__name__)
tracer = trace.get_tracer("agentmesh")
# Housekeeping between services (lease renewals, the reaper's rounds) is not traced: it is not a
# request's work, and it would start a new trace every few seconds.
_UNTRACED_SERVICES = ("agentmesh.leases.v1.LeaseService",)
_UNTRACED_METHODS = ("RenewStreams",)

_provider: Any = None


def endpoint() -> str:
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def enabled() -> bool:
    return _provider is not None


def setup(service: str, exporter: Any = None) -> bool:
    """Installs tracing for this process when an OTLP endpoint is configured (or a test gives an
    `exporter`, whose spans are then exported one by one); returns whether tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if exporter is None and not endpoint():
        return False
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    name = os.environ.get("OTEL_SERVICE_NAME") or f"agentmesh-{service}"
    resource = Resource.create({"service.name": name, "service.namespace": "agentmesh"})
    provider = TracerProvider(resource=resource)
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    HTTPXClientInstrumentor().instrument()
    _provider = provider
    log.info("tracing on", extra={"otel_service": name, "otlp_endpoint": endpoint()})
    return True


def shutdown() -> None:
    """Exports what is still buffered (at a clean exit)."""
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.shutdown()


def _traced() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(
        filters.any_of(
            filters.health_check(),  # also: its Watch streams with context.write, no generator to wrap
            filters.service_prefix("grpc.reflection."),
            *(filters.service_name(s) for s in _UNTRACED_SERVICES),
            *(filters.method_name(m) for m in _UNTRACED_METHODS),
        )
    )


def client_interceptors() -> list[Any]:
    """The OpenTelemetry interceptors of a channel (a client span per call, `traceparent` injected);
    none when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return list(aio_client_interceptors(filter_=_traced()))


def server_interceptors() -> list[Any]:
    """The OpenTelemetry interceptor of a server (a server span per call, its parent from the caller's
    `traceparent`); none when tracing is off."""
    if _provider is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(filter_=_traced())]


def instrument_app(app: Any) -> None:
    """A server span per HTTP request of the gateway, its parent from the request's `traceparent`."""
    if _provider is None:
        return
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, excluded_urls="healthz,metrics")


@contextlib.contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span]:
    """A span of our own work around the block, child of the current one; attributes are prefixed
    `agentmesh.` (empty values left out). An exception marks it failed and propagates."""
    attrs = {f"agentmesh.{k}": v for k, v in attributes.items() if v not in ("", None)}
    with tracer.start_as_current_span(name, attributes=attrs) as current:
        yield current


@contextlib.contextmanager
def model_span(model: str, base_url: str) -> Iterator[Span]:
    """A client span around one model call (the `openai` client speaks httpx2, which no OpenTelemetry
    instrumentation covers), with the GenAI semantic conventions' attributes."""
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or ""
    attrs = {"gen_ai.operation.name": "chat", "gen_ai.request.model": model, "server.address": host}
    with tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT, attributes=attrs) as current:
        yield current


def headers() -> dict[str, str]:
    """The W3C trace context of the current span as HTTP headers (empty when tracing is off)."""
    out: dict[str, str] = {}
    if _provider is not None:
        from opentelemetry.propagate import inject

        inject(out)
    return out


def fail(current: Span, code: str, message: str = "") -> None:
    """Marks a span failed with one of the error table's codes (a failure that did not raise)."""
    current.set_attribute("agentmesh.error_code", code)
    current.set_status(Status(StatusCode.ERROR, message or code))


def current_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span as hex, or ("", "") outside any recorded span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


@contextlib.contextmanager
def continued(traceparent: str) -> Iterator[None]:
    """Runs the block in the trace of a W3C `traceparent` that came in a message rather than a header
    (A2A message metadata); nothing when tracing is off or the value is empty."""
    if _provider is None or not traceparent:
        yield
        return
    from opentelemetry import context as otel_context
    from opentelemetry.propagate import extract

    token = otel_context.attach(extract({"traceparent": traceparent}))
    try:
        yield
    finally:
        otel_context.detach(token)
