"""libs.log and libs.telemetry without any service: a JSON log line carries the trace and span ids of
the span it was written in (none outside one), and tracing is off, with nothing installed, unless an
OTLP endpoint is configured; every line (uvicorn's, warnings) goes through the one formatter, JSON
unless on a terminal, with no colour codes."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from agentmesh.libs import telemetry
from agentmesh.libs.log import JsonFormatter, setup_logging, wants_json


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


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_no_terminal_colours_reach_a_json_line() -> None:
    """uvicorn logs its start with a coloured copy of the message (`color_message`): dropped; escape
    sequences in the text itself are removed."""
    record = logging.LogRecord(
        "uvicorn.error", logging.INFO, __file__, 1, "Started server process [%d]", (7,), None
    )
    record.color_message = "Started server process [\x1b[36m%d\x1b[0m]"
    record.note = "\x1b[1mbold\x1b[0m"
    text = JsonFormatter("gateway").format(record)
    assert "\x1b" not in text and "\\u001b" not in text
    out = json.loads(text)
    assert out["msg"] == "Started server process [7]" and out["note"] == "bold" and "color_message" not in out


def test_uvicorn_access_lines_have_fields() -> None:
    args = ("127.0.0.1:5000", "GET", "/healthz", "1.1", 200)
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', args, None
    )
    out = json.loads(JsonFormatter("gateway").format(record))
    assert out["msg"] == '127.0.0.1:5000 - "GET /healthz HTTP/1.1" 200'
    assert (out["client"], out["method"], out["path"], out["status"]) == (
        "127.0.0.1:5000",
        "GET",
        "/healthz",
        200,
    )


def test_json_unless_a_terminal() -> None:
    assert wants_json(None, io.StringIO()) is True
    assert wants_json(None, Terminal()) is False
    assert wants_json(True, Terminal()) is True and wants_json(False, io.StringIO()) is False


@pytest.mark.usefixtures("restore_logging")
def test_every_line_goes_through_the_one_handler() -> None:
    """uvicorn's loggers, configured or not, and Python's warnings: JSON lines of the service."""
    stream = io.StringIO()
    logging.getLogger("uvicorn.error").addHandler(
        logging.StreamHandler(io.StringIO())
    )  # as a dictConfig would
    logging.getLogger("uvicorn.error").propagate = False
    setup_logging("gateway", stream=stream, access_log=True)
    logging.getLogger("uvicorn.error").info("Application startup complete.")
    logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', "c", "GET", "/", "1.1", 200)
    warnings.warn("a library is deprecated", DeprecationWarning, stacklevel=1)
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert [x["logger"] for x in lines] == ["uvicorn.error", "uvicorn.access", "py.warnings"]
    assert all(x["service"] == "gateway" for x in lines)
    terminal = Terminal()
    setup_logging("gateway", stream=terminal)
    logging.getLogger("agentmesh.test").warning("\x1b[31mred\x1b[0m")
    assert terminal.getvalue().endswith(" gateway WARNING agentmesh.test: red\n")


KEY = "am_" + "Zx9" * 14


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize("json_lines", [True, False])
def test_api_keys_never_reach_a_log_line(json_lines: bool) -> None:
    """Issue 39, point 5: `GET /api/ws?apiKey=...` logged the key in plain text at INFO."""
    stream = io.StringIO()
    setup_logging("gateway", "INFO", json_lines, access_log=True, stream=stream)
    access = logging.getLogger("uvicorn.access")
    access.info('%s - "%s %s HTTP/%s" %d', "c", "GET", f"/api/ws?apiKey={KEY}&x=1", "1.1", 101)
    access.info('%s - "%s %s HTTP/%s" %d', "c", "GET", "/api/ws?token=secret-token-value", "1.1", 101)
    log = logging.getLogger("agentmesh.test")
    log.warning("peer answered for Authorization: Bearer %s", "peer-secret-credential")
    log.warning("a key in prose: %s", KEY)
    try:
        raise RuntimeError(f"refused key {KEY}")
    except RuntimeError:
        log.exception("failed")
    text = stream.getvalue()
    for secret in (KEY, "secret-token-value", "peer-secret-credential", KEY[3:]):
        assert secret not in text, text
    assert text.count("[redacted]") >= 5
    if json_lines:
        first = json.loads(text.splitlines()[0])
        assert first["path"] == "/api/ws?apiKey=[redacted]&x=1" and first["status"] == 101
