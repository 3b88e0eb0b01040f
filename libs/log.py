"""Structured logs: one JSON object a line, with the service name and, inside a traced request, its
OpenTelemetry trace and span ids (`trace_id`, `span_id`), so a line leads to its trace.

One formatter for every line a process writes: its own loggers, the libraries' (uvicorn's error and
access loggers, alembic, ...) and Python's warnings all reach the root handler set up here. JSON unless
stderr is a terminal (then one readable line each; `AGENTMESH_LOG_JSON` decides when set), and never
a terminal colour code: uvicorn's `color_message` is dropped and ANSI escapes are removed from the
text. gRPC core writes its own lines straight to stderr, past any formatter: `quiet_grpc_core` turns
them off unless GRPC_VERBOSITY says otherwise (what they say reaches the caller as the call's error).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from typing import Any, TextIO

from agentmesh.libs.telemetry import current_ids

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
_DROPPED = {"color_message"}  # uvicorn's copy of the message with terminal colours
_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# The arguments of uvicorn's access line ('%s - "%s %s HTTP/%s" %d'), as fields of their own.
_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")


# Secrets that can reach a log line (an access line's query string, a header echoed in an error): the
# value after apiKey=, token=, key=, secret=, password= (query strings, forms), after "Bearer ", and any
# agentmesh API key (am_...), wherever it stands.
_SECRET_PARAM = re.compile(
    r"(?i)\b((?:api[_-]?key|access[_-]?token|token|key|secret|password|authorization)=)[^&\s\"'#]+"
)
_BEARER = re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+")
_API_KEY = re.compile(r"\bam_[A-Za-z0-9_-]{8,}")
REDACTED = "[redacted]"


def redact(text: str) -> str:
    """`text` with every secret it shows replaced by [redacted]."""
    text = _SECRET_PARAM.sub(rf"\1{REDACTED}", text)
    text = _BEARER.sub(rf"\1{REDACTED}", text)
    return _API_KEY.sub(f"am_{REDACTED}", text)


def plain(text: str) -> str:
    """`text` without terminal escape sequences (colours, cursor moves) and with its secrets redacted."""
    return redact(_ANSI.sub("", text) if "\x1b" in text else text)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": plain(record.getMessage()),
        }
        trace_id, span_id = current_ids()
        if trace_id:
            out["trace_id"], out["span_id"] = trace_id, span_id
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(_ACCESS_FIELDS, (_field(arg) for arg in record.args), strict=True))
        for key, value in record.__dict__.items():
            if key not in _RESERVED and key not in _DROPPED and not key.startswith("_"):
                out[key] = _field(value)
        if record.exc_info:
            out["exc"] = plain(self.formatException(record.exc_info))
        return json.dumps(out, ensure_ascii=False)


def _field(value: Any) -> object:
    if isinstance(value, str):
        return plain(value)
    return value if isinstance(value, int | float | bool | None) else plain(repr(value))


class TextFormatter(logging.Formatter):
    """One readable line for a terminal, without colour codes."""

    def format(self, record: logging.LogRecord) -> str:
        return plain(super().format(record))


def wants_json(json_lines: bool | None, stream: TextIO) -> bool:
    """The setting when given, else JSON unless the stream is a terminal."""
    if json_lines is not None:
        return json_lines
    isatty = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


def setup_logging(
    service: str,
    level: str = "INFO",
    json_lines: bool | None = None,
    *,
    access_log: bool = False,
    stream: TextIO | None = None,
) -> None:
    """Every log line of this process through one handler on stderr (or `stream`): JSON lines, or
    text on a terminal (`json_lines` None: decide by the stream). `access_log`: uvicorn's line per
    HTTP request too (the gateway's AGENTMESH_GATEWAY_ACCESS_LOG)."""
    stream = stream if stream is not None else sys.stderr
    handler = logging.StreamHandler(stream)
    if wants_json(json_lines, stream):
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(TextFormatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in UVICORN_LOGGERS:  # whatever configured them before: their lines go to the root's handler
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.captureWarnings(True)  # `warnings.warn` (a library's deprecation) is a log line too
    for noisy in ("httpx", "httpcore", "openai", "aiosqlite", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").setLevel(logging.INFO if access_log else logging.WARNING)


def quiet_grpc_core() -> None:
    """gRPC core logs past Python's logging, in a format of its own: off (GRPC_VERBOSITY=NONE) unless
    the environment sets GRPC_VERBOSITY. Call it before anything imports gRPC."""
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
