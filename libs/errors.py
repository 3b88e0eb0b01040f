"""One table of errors: each REASON maps to a gRPC status, an HTTP status and the `error` event code.

Domain code raises a `MeshError` subclass. `grpc_errors` (a servicer decorator) aborts the RPC with
its gRPC status carrying `google.rpc.ErrorInfo(reason, domain)`; a client turns the failed RPC back
into the same class with `from_rpc_error` (by reason, so ModelError stays ModelError across hops);
the gateway answers HTTP with the table's status and `{"error": {code, reason, message}}`; a run
that fails ends its buffer with `StreamError(code=...)` from the same row.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, NamedTuple, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import deadlines

DOMAIN = "agentmesh.dev"
log = logging.getLogger(__name__)
S = grpc.StatusCode


class Row(NamedTuple):
    """How one REASON travels: as a gRPC status, an HTTP status and an `error` event code."""

    grpc: grpc.StatusCode
    http: int
    code: int  # agentmesh.events.v1.ErrorCode


TABLE: dict[str, Row] = {
    "INVALID_ARGUMENT": Row(S.INVALID_ARGUMENT, 422, ev.ERROR_CODE_INVALID_ARGUMENT),
    "NOT_FOUND": Row(S.NOT_FOUND, 404, ev.ERROR_CODE_NOT_FOUND),
    "ALREADY_EXISTS": Row(S.ALREADY_EXISTS, 409, ev.ERROR_CODE_ALREADY_EXISTS),
    "FAILED_PRECONDITION": Row(S.FAILED_PRECONDITION, 409, ev.ERROR_CODE_FAILED_PRECONDITION),
    "VERSION_MISMATCH": Row(S.ABORTED, 412, ev.ERROR_CODE_FAILED_PRECONDITION),
    "RESOURCE_EXHAUSTED": Row(S.RESOURCE_EXHAUSTED, 413, ev.ERROR_CODE_RESOURCE_EXHAUSTED),
    "UNAUTHENTICATED": Row(S.UNAUTHENTICATED, 401, ev.ERROR_CODE_UNAUTHENTICATED),
    "PERMISSION_DENIED": Row(S.PERMISSION_DENIED, 403, ev.ERROR_CODE_PERMISSION_DENIED),
    "DEPTH_EXCEEDED": Row(S.FAILED_PRECONDITION, 422, ev.ERROR_CODE_DEPTH_EXCEEDED),
    "DEADLINE_EXCEEDED": Row(S.DEADLINE_EXCEEDED, 504, ev.ERROR_CODE_TIMEOUT),
    "MODEL_TIMEOUT": Row(S.DEADLINE_EXCEEDED, 504, ev.ERROR_CODE_TIMEOUT),
    "MODEL_ERROR": Row(S.UNAVAILABLE, 502, ev.ERROR_CODE_MODEL_ERROR),
    "MODEL_UNREACHABLE": Row(S.UNAVAILABLE, 502, ev.ERROR_CODE_MODEL_UNREACHABLE),
    "UNAVAILABLE": Row(S.UNAVAILABLE, 503, ev.ERROR_CODE_UNAVAILABLE),
    "OVERLOADED": Row(S.RESOURCE_EXHAUSTED, 429, ev.ERROR_CODE_UNAVAILABLE),
    "SHUTDOWN": Row(S.UNAVAILABLE, 503, ev.ERROR_CODE_SHUTDOWN),
    "INTERRUPTED": Row(S.ABORTED, 503, ev.ERROR_CODE_INTERRUPTED),
    "IDLE_TIMEOUT": Row(S.DEADLINE_EXCEEDED, 504, ev.ERROR_CODE_IDLE_TIMEOUT),
    "CANCELLED": Row(S.CANCELLED, 499, ev.ERROR_CODE_CANCELLED),
    "INTERNAL": Row(S.INTERNAL, 500, ev.ERROR_CODE_INTERNAL),
    "REMOTE_FAILED": Row(S.ABORTED, 502, ev.ERROR_CODE_REMOTE_FAILED),
}
_CODE_NAME = ev.ErrorCode.DESCRIPTOR


def code_name(code: int) -> str:
    """The browser form of an ErrorCode: ERROR_CODE_MODEL_ERROR -> "model_error"."""
    value = _CODE_NAME.values_by_number.get(code)
    if value is None or code == 0:
        return "internal"
    return value.name.removeprefix("ERROR_CODE_").lower()


def code_from_name(name: str) -> int:
    """The inverse of code_name ("model_error" -> ERROR_CODE_MODEL_ERROR); INTERNAL when unknown."""
    value = _CODE_NAME.values_by_name.get("ERROR_CODE_" + name.upper())
    return value.number if value is not None else ev.ERROR_CODE_INTERNAL


class MeshError(Exception):
    """Base of every error the mesh reports to a caller; `reason` picks its row of TABLE."""

    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason and reason in TABLE:
            self.reason = reason  # type: ignore[misc]

    @property
    def row(self) -> Row:
        return TABLE[self.reason]

    @property
    def http_status(self) -> int:
        return self.row.http

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.row.grpc

    @property
    def code(self) -> int:
        """The ErrorCode of the `error` event (and of a failed tool call)."""
        return self.row.code

    @property
    def code_name(self) -> str:
        return code_name(self.code)

    def to_event(self) -> ev.StreamError:
        return ev.StreamError(code=self.code, message=self.message)  # type: ignore[arg-type]

    def json_body(self) -> dict[str, Any]:
        """The gateway's HTTP error body."""
        return {"error": {"code": self.http_status, "reason": self.reason, "message": self.message}}


class InvalidArgument(MeshError):
    reason = "INVALID_ARGUMENT"


class NotFound(MeshError):
    reason = "NOT_FOUND"


class AlreadyExists(MeshError):
    reason = "ALREADY_EXISTS"


class FailedPrecondition(MeshError):
    reason = "FAILED_PRECONDITION"


class VersionMismatch(MeshError):
    """An optimistic-concurrency write against a stale version (HTTP 412)."""

    reason = "VERSION_MISMATCH"


class ResourceExhausted(MeshError):
    reason = "RESOURCE_EXHAUSTED"


class Unauthenticated(MeshError):
    reason = "UNAUTHENTICATED"


class PermissionDenied(MeshError):
    reason = "PERMISSION_DENIED"


class DepthExceeded(MeshError):
    reason = "DEPTH_EXCEEDED"


class DeadlineExceeded(MeshError):
    reason = "DEADLINE_EXCEEDED"


class ModelError(MeshError):
    """The model endpoint failed (HTTP error, cut connection, bad stream)."""

    reason = "MODEL_ERROR"


class ModelUnreachable(MeshError):
    """The model endpoint could not be reached (connection refused, no route, unknown host)."""

    reason = "MODEL_UNREACHABLE"


class ModelTimeout(MeshError):
    """The model request timed out."""

    reason = "MODEL_TIMEOUT"


class Unavailable(MeshError):
    reason = "UNAVAILABLE"


class Overloaded(MeshError):
    """The mesh runs as many turns as it may (AGENTMESH_MAX_TURNS): a new one is refused at once, to be
    asked again shortly (HTTP 429 with Retry-After), never accepted and left to starve."""

    reason = "OVERLOADED"


class Shutdown(MeshError):
    reason = "SHUTDOWN"


class Interrupted(MeshError):
    """The process that ran a turn died; a surviving service settled what it left."""

    reason = "INTERRUPTED"


class IdleTimeout(MeshError):
    reason = "IDLE_TIMEOUT"


class Cancelled(MeshError):
    reason = "CANCELLED"


class Internal(MeshError):
    reason = "INTERNAL"


class RemoteFailed(MeshError):
    """A remote A2A agent ended its task failed (or rejected it)."""

    reason = "REMOTE_FAILED"


_BY_REASON: dict[str, type[MeshError]] = {
    cls.reason: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        VersionMismatch,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        DepthExceeded,
        DeadlineExceeded,
        ModelError,
        ModelUnreachable,
        ModelTimeout,
        Unavailable,
        Overloaded,
        Shutdown,
        Interrupted,
        IdleTimeout,
        Cancelled,
        Internal,
        RemoteFailed,
    )
}
_BY_GRPC: dict[grpc.StatusCode, type[MeshError]] = {
    S.INVALID_ARGUMENT: InvalidArgument,
    S.OUT_OF_RANGE: InvalidArgument,
    S.NOT_FOUND: NotFound,
    S.ALREADY_EXISTS: AlreadyExists,
    S.FAILED_PRECONDITION: FailedPrecondition,
    S.ABORTED: FailedPrecondition,
    S.RESOURCE_EXHAUSTED: ResourceExhausted,
    S.UNAUTHENTICATED: Unauthenticated,
    S.PERMISSION_DENIED: PermissionDenied,
    S.DEADLINE_EXCEEDED: DeadlineExceeded,
    S.UNAVAILABLE: Unavailable,
    S.CANCELLED: Cancelled,
}
_BY_CODE: dict[int, type[MeshError]] = {}
for _reason, _row in TABLE.items():
    _BY_CODE.setdefault(_row.code, _BY_REASON[_reason])
_BY_CODE[ev.ERROR_CODE_TIMEOUT] = DeadlineExceeded


def from_event(error: ev.StreamError) -> MeshError:
    """The error behind an `error` event."""
    return _BY_CODE.get(error.code, Internal)(error.message or code_name(error.code))


def to_status(err: MeshError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=err.grpc_code.value[0], message=err.message, details=[detail])
    return rpc_status.to_status(status)


def from_reason(reason: str, message: str) -> MeshError:
    """The error a REASON of the table names (one sent as data, e.g. a stream's per-item error)."""
    return _BY_REASON.get(reason, Internal)(message or reason)


# grpc.aio's words for a message it could not send because the call ended under it at that moment
# (its connection lost, or the server's end racing the send): it reports INTERNAL, hiding the call's
# own status, which it never read.
LOST_SEND = "Internal error from Core"


def is_lost_send(exc: grpc.RpcError) -> bool:
    """The call failed because a send of it could not go out (LOST_SEND), its own status unknown."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else None
    return code == grpc.StatusCode.INTERNAL and details == LOST_SEND


def error_reason(exc: grpc.RpcError) -> str:
    """The ErrorInfo reason one of our services sent with a failed RPC; "" when the failure is not
    theirs (the transport's: a process gone, a connection refused or cut)."""
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - malformed trailers
        return ""
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info) and info.domain == DOMAIN:
                return str(info.reason)
    return ""


def from_rpc_error(exc: grpc.RpcError) -> MeshError:
    """The domain error behind a failed RPC: by the ErrorInfo reason our services send, else by the
    gRPC status code."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = exc.details() if hasattr(exc, "details") else str(exc)
    reason = error_reason(exc)
    if not reason and is_lost_send(exc):
        code = grpc.StatusCode.UNAVAILABLE  # the call's own status is unknown: gone, as far as we can tell
    cls = _BY_REASON.get(reason) or _BY_GRPC.get(code, Internal)
    if not reason and code in _TRANSPORT_WORDS:
        # gRPC's own words (an address: "ipv4:127.0.0.1:50313: Failed to connect ... Connection refused",
        # "Socket closed", "Exception calling application") go to the log, never to a user or a message
        log.info("rpc failed: %s: %s", code.name, message)
        message = _TRANSPORT_WORDS[code]
    return cls(message or code.name)


# What a failed call without our ErrorInfo says to a user, by its status: gRPC's own details name
# addresses and library internals.
_TRANSPORT_WORDS: dict[grpc.StatusCode, str] = {
    S.UNAVAILABLE: "a service of the mesh is unavailable; try again shortly",
    S.UNKNOWN: "internal error",
    S.INTERNAL: "internal error",
    S.DATA_LOSS: "internal error",
    S.UNIMPLEMENTED: "internal error",
}


T = TypeVar("T")


async def rpc(aw: Awaitable[T]) -> T:
    """Awaits a gRPC call; a failure comes back as the domain error behind it (MeshError)."""
    try:
        return await aw
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc


def as_mesh_error(exc: BaseException) -> MeshError:
    """Any failure of a downstream call as a MeshError (an AioRpcError keeps its reason)."""
    if isinstance(exc, MeshError):
        return exc
    if isinstance(exc, grpc.aio.AioRpcError):
        return from_rpc_error(exc)
    log.error("internal error: %s: %s", type(exc).__name__, exc)  # Python's words stay in the log
    return Internal("internal error")


async def _abort(context: grpc.aio.ServicerContext, err: MeshError) -> None:
    await context.abort_with_status(to_status(err))


F = TypeVar("F", bound=Callable[..., Any])


def grpc_errors(fn: F) -> F:
    """Servicer method decorator: MeshError (or a downstream AioRpcError) -> its gRPC status; anything
    else -> INTERNAL without a trace. The call's deadline is recorded for what it calls (libs.deadlines)."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            deadlines.serve(context)
            try:
                async for item in fn(self, request, context):
                    yield item
            except MeshError as err:
                await _abort(context, err)
            except grpc.aio.AioRpcError as exc:  # a downstream service's error keeps its reason
                await _abort(context, from_rpc_error(exc))
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("unhandled error in %s", fn.__qualname__)
                await _abort(context, Internal("internal error"))

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        deadlines.serve(context)
        try:
            return await fn(self, request, context)
        except MeshError as err:
            await _abort(context, err)
        except grpc.aio.AioRpcError as exc:  # a downstream service's error keeps its reason
            await _abort(context, from_rpc_error(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", fn.__qualname__)
            await _abort(context, Internal("internal error"))

    return wrapper  # type: ignore[return-value]
