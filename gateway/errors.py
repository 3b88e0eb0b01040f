"""The gateway's HTTP errors: every answer outside 2xx is `{"error": {code, reason, message}}` with a
reason from the one table (libs/errors.py), and the OpenAPI document says which ones a route can give.

- `HttpError`: a MeshError with an HTTP status of its own, for what only HTTP has (405, 408, 414, 431):
  its reason is a row of the table (RESOURCE_EXHAUSTED: the status says which part failed) or, with no
  row to stand for it, a reason of HTTP's own (METHOD_NOT_ALLOWED).
- Every 401 says how to authenticate: `WWW-Authenticate: Bearer` (RFC 9110 11.6.1, RFC 6750 3).
- `install(app)`: handlers for what FastAPI and Starlette raise themselves (unknown routes and methods,
  bodies that are not JSON, failed validation) and a last one for anything else: a 500 with the same
  body and no traceback (the traceback goes to the log).
- `responses(...)`: the `responses=` of a route, built from the table.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from agentmesh.libs.errors import TABLE, Internal, InvalidArgument, MeshError, NotFound, Row, from_rpc_error

log = logging.getLogger(__name__)


class HttpError(MeshError):
    """An error whose HTTP status is not its reason's row: `reason` is one of TABLE or of HTTP_ONLY."""

    def __init__(self, message: str, *, reason: str, status: int) -> None:
        super().__init__(message, reason=reason)
        self.reason = reason  # type: ignore[misc]
        self.status = status

    @property
    def row(self) -> Row:
        """TABLE's row, or for an HTTP-only reason the row of INVALID_ARGUMENT (the request was wrong)."""
        return TABLE.get(self.reason) or TABLE["INVALID_ARGUMENT"]

    @property
    def http_status(self) -> int:
        return self.status


# What only HTTP has, by status: the reason each is reported under.
HTTP_ONLY: dict[int, tuple[str, str]] = {
    408: ("DEADLINE_EXCEEDED", "the request head or body did not arrive in time (the connection closes)"),
    405: ("METHOD_NOT_ALLOWED", "the route has no such method (Allow lists the ones it has)"),
    414: ("RESOURCE_EXHAUSTED", "request line over 8 KiB"),
    431: ("RESOURCE_EXHAUSTED", "request headers over the limits (count, line, total)"),
}


# The challenge of every 401 (the gateway's only scheme: an API key as a bearer token).
CHALLENGE = {"WWW-Authenticate": 'Bearer realm="agentmesh"'}


def error_response(err: MeshError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    out = dict(headers or {})
    if err.http_status == 401:
        out.update(CHALLENGE)
    return JSONResponse(err.json_body(), status_code=err.http_status, headers=out)


def _allowed_methods(request: Request) -> list[str]:
    """The methods the OpenAPI document lists for the path, a concrete path before a templated one (as
    OpenAPI matches): the document says what a path serves (Starlette's own 405 names only the first
    matching route's methods); paths outside it are the UI's static files (GET, HEAD)."""
    app = request.app
    paths = getattr(app.state, "openapi_paths", None)
    if paths is None:
        paths = []
        for template, item in app.openapi()["paths"].items():
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            methods = [
                m.upper() for m in item if m in ("get", "put", "post", "delete", "options", "head", "patch")
            ]
            paths.append(("{" in template, re.compile(pattern), methods))
        for template, methods in getattr(app.state, "undocumented_paths", ()):  # A2A: not in the document
            pattern = re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template))
            paths.append(("{" in template, re.compile(pattern), list(methods)))
        paths.sort(key=lambda entry: entry[0])  # concrete paths first
        app.state.openapi_paths = paths
    path = request.url.path
    for _, pattern, methods in paths:
        if pattern.fullmatch(path):
            return [m for m in ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS") if m in methods]
    return ["GET", "HEAD"]


def _body_error(exc: HTTPException) -> MeshError | None:
    """FastAPI answers a body it cannot decode with a bare 400; its cause says why."""
    cause = exc.__cause__
    if isinstance(cause, UnicodeDecodeError):
        return InvalidArgument("request body is not valid UTF-8")
    if isinstance(cause, RecursionError):
        return InvalidArgument("request body JSON is nested too deeply")
    if exc.status_code == 400:
        return InvalidArgument("request body is not valid JSON")
    return None


def _http_exception(request: Request, exc: HTTPException) -> JSONResponse:
    headers = dict(exc.headers or {})
    err = _body_error(exc)
    if err is not None:
        return error_response(err)
    if exc.status_code == 404:
        return error_response(NotFound(f"no route {request.url.path[:200]}"), headers)
    if exc.status_code == 405:
        allowed = _allowed_methods(request)
        headers["Allow"] = ", ".join(allowed)
        reason, _ = HTTP_ONLY[405]
        message = f"{request.method[:20]} is not allowed here; allowed: {', '.join(allowed)}"
        return error_response(HttpError(message, reason=reason, status=405), headers)
    reason = next((r for r, row in TABLE.items() if row.http == exc.status_code), "")
    if not reason:
        reason = HTTP_ONLY.get(
            exc.status_code, ("INVALID_ARGUMENT" if exc.status_code < 500 else "INTERNAL",)
        )[0]
    message = exc.detail if isinstance(exc.detail, str) else "request failed"
    return error_response(HttpError(message, reason=reason, status=exc.status_code), headers)


def _location(loc: Iterable[Any]) -> str:
    return ".".join(str(part) for part in loc)


def install(app: FastAPI) -> None:
    """The exception handlers that give every error the gateway's JSON body."""

    def answer(request: Request, err: MeshError) -> JSONResponse:
        headers = {}
        if err.http_status == 429:  # the mesh at capacity (Overloaded): when to ask again
            headers["Retry-After"] = str(request.app.state.settings.retry_after_s)
        return error_response(err, headers)

    @app.exception_handler(MeshError)
    async def mesh_error(request: Request, err: MeshError) -> JSONResponse:
        return answer(request, err)

    @app.exception_handler(grpc.aio.AioRpcError)
    async def rpc_error(request: Request, exc: grpc.aio.AioRpcError) -> JSONResponse:
        return answer(request, from_rpc_error(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        details = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))[:300]} for e in errors[:20]]
        first = f": {_location(details[0]['loc'])}: {details[0]['msg']}" if details else ""
        body = InvalidArgument(f"invalid request{first}").json_body()
        body["error"]["details"] = details
        return JSONResponse(body, status_code=422)

    @app.exception_handler(HTTPException)
    async def http_exception(request: Request, exc: HTTPException) -> JSONResponse:
        return _http_exception(request, exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette logs the traceback too (it re-raises after this answer); the body never carries it.
        return error_response(Internal("internal error"))


# ---- the OpenAPI side ------------------------------------------------------------------------------

_DETAILS = {
    "type": "array",
    "description": "each failed check of the request (422 from validation)",
    "items": {
        "type": "object",
        "properties": {"loc": {"type": "array", "items": {}}, "msg": {"type": "string"}},
        "required": ["loc", "msg"],
    },
}


def reasons_for(status: int) -> list[str]:
    """The reasons of TABLE (and of HTTP_ONLY) answered with this HTTP status."""
    found = [reason for reason, row in TABLE.items() if row.http == status]
    if status in HTTP_ONLY and HTTP_ONLY[status][0] not in found:
        found.append(HTTP_ONLY[status][0])
    return found


def error_schema(status: int) -> dict[str, Any]:
    """The JSON Schema of an error body with this status."""
    reasons = reasons_for(status)
    if not reasons:
        raise ValueError(f"no reason of libs/errors.py TABLE answers HTTP {status}")
    inner: dict[str, Any] = {
        "type": "object",
        "properties": {
            "code": {"type": "integer", "const": status},
            "reason": {"type": "string", "enum": reasons},
            "message": {"type": "string"},
        },
        "required": ["code", "reason", "message"],
    }
    if status == 422:
        inner["properties"]["details"] = _DETAILS
    return {"type": "object", "properties": {"error": inner}, "required": ["error"]}


_WHY = {
    401: "missing or unknown API key (send Authorization: Bearer KEY)",
    403: "a built-in agent cannot change",
    404: "no such resource, or one owned by somebody else (the same answer)",
    409: "a conflict: a turn is already running on the session, or an agent of that slug exists",
    412: "the agent changed since the version If-Match names",
    413: "request body over 1 MiB",
    422: "the request breaks a bound or a format of this document",
    429: "the mesh runs as many turns as it may (AGENTMESH_MAX_TURNS): ask again after Retry-After",
    503: "a service of the mesh behind the gateway is unavailable",
    504: "a service of the mesh did not answer in time",
}


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error responses of a route, for FastAPI's `responses=`: each with its JSON body schema, the
    reasons of libs/errors.py it can carry and why it happens. Every route also gets 414 and 431 (the
    request head limits hold everywhere)."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, 414, 431}):
        why = _WHY.get(status) or HTTP_ONLY[status][1]
        out[status] = {
            "description": f"{why} ({', '.join(reasons_for(status))})",
            "content": {"application/json": {"schema": error_schema(status)}},
        }
        if status == 429:
            out[status]["headers"] = {
                "Retry-After": {
                    "description": "seconds to wait before asking again",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^[0-9]+$"},
                }
            }
        if status == 401:
            out[status]["headers"] = {
                "WWW-Authenticate": {
                    "description": "the scheme to authenticate with: Bearer",
                    "required": True,
                    "schema": {"type": "string", "pattern": "^Bearer"},
                }
            }
    return out


# The sets routes combine.
AUTH = (401, 503, 504)  # every /api route: the key is checked against the mesh
READ = (*AUTH, 404, 422)
WRITE = (*READ, 413)

SSE: dict[str, Any] = {
    "description": "Server-Sent Events, ending after the terminal `finish` or `error` event: per event "
    "`id: <offset>` (resume after it with Last-Event-ID) and `data: <event JSON>`",
    "content": {
        "text/event-stream": {
            "schema": {  # one event (OpenAPI 3.1: the schema of a text/event-stream describes each event)
                "type": "object",
                "properties": {
                    "data": {"type": "string", "contentMediaType": "application/json"},
                    "id": {"type": "string", "pattern": "^[0-9]{1,20}(-[0-9]{1,20})?$"},
                    "event": {"const": "message"},
                },
                "required": ["data"],
            }
        }
    },
}
