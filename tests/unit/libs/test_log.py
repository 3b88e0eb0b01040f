"""libs.log and libs.telemetry without any service: a JSON log line carries the trace and span ids of
the span it was written in (none outside one), and tracing is off, with nothing installed, unless an
OTLP endpoint is configured."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider

from agentmesh.libs import telemetry
from agentmesh.libs.log import JsonFormatter


def line(message: str) -> dict[str, object]:
    record = logging.LogRecord("agentmesh.test", logging.INFO, __file__, 1, message, (), None)
    record.session = "s-1"
    return json.loads(JsonFormatter("orchestrator").format(record))  # type: ignore[no-any-return]


def test_a_line_written_inside_a_span_carries_its_trace_and_span_ids() -> None:
    tracer = TracerProvider().get_tracer("test")  # a provider of its own: the process's stays untouched
    with tracer.start_as_current_span("turn") as span:
        inside = line("turn ended")
    ctx = span.get_span_context()
    assert inside["trace_id"] == format(ctx.trace_id, "032x")
    assert inside["span_id"] == format(ctx.span_id, "016x")
    assert inside["service"] == "orchestrator" and inside["session"] == "s-1"
    outside = line("serving")
    assert "trace_id" not in outside and "span_id" not in outside


def test_tracing_is_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert telemetry.setup("orchestrator") is False
    assert not telemetry.enabled()
    assert telemetry.client_interceptors() == [] and telemetry.server_interceptors() == []
    assert telemetry.headers() == {}
    with telemetry.span("turn", agent="general") as span:
        assert not span.is_recording()
        assert telemetry.current_ids() == ("", "")
