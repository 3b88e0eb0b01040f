"""One table of domain errors: each maps to an HTTP status, a gRPC status code and a REASON.

Services raise `MeshError` subclasses from domain code; `grpc_errors` turns them into a gRPC
status carrying `google.rpc.ErrorInfo(reason, domain)`; clients turn an `AioRpcError` back into
the same class with `from_rpc_error`, so the gateway answers HTTP with the table's code.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ClassVar, TypeVar

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "agentmesh.dev"
log = logging.getLogger(__name__)


class MeshError(Exception):
    """Base of every error the mesh reports to a caller."""

    http_status: ClassVar[int] = 500
    grpc_code: ClassVar[grpc.StatusCode] = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = "INTERNAL"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason:
            self.reason = reason  # type: ignore[misc]


class InvalidArgument(MeshError):
    http_status, grpc_code, reason = 422, grpc.StatusCode.INVALID_ARGUMENT, "INVALID_ARGUMENT"


class NotFound(MeshError):
    http_status, grpc_code, reason = 404, grpc.StatusCode.NOT_FOUND, "NOT_FOUND"


class AlreadyExists(MeshError):
    http_status, grpc_code, reason = 409, grpc.StatusCode.ALREADY_EXISTS, "ALREADY_EXISTS"


class FailedPrecondition(MeshError):
    http_status, grpc_code, reason = 409, grpc.StatusCode.FAILED_PRECONDITION, "FAILED_PRECONDITION"


class ResourceExhausted(MeshError):
    http_status, grpc_code, reason = 413, grpc.StatusCode.RESOURCE_EXHAUSTED, "RESOURCE_EXHAUSTED"


class Unauthenticated(MeshError):
    http_status, grpc_code, reason = 401, grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED"


class DeadlineExceeded(MeshError):
    http_status, grpc_code, reason = 504, grpc.StatusCode.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED"


class Unavailable(MeshError):
    http_status, grpc_code, reason = 503, grpc.StatusCode.UNAVAILABLE, "UNAVAILABLE"


class Cancelled(MeshError):
    http_status, grpc_code, reason = 499, grpc.StatusCode.CANCELLED, "CANCELLED"


class Internal(MeshError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[MeshError]] = {
    cls.grpc_code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unauthenticated,
        DeadlineExceeded,
        Unavailable,
        Cancelled,
        Internal,
    )
}


def to_status(err: MeshError) -> grpc.Status:
    info = error_details_pb2.ErrorInfo(reason=err.reason, domain=DOMAIN)
    detail = any_pb2.Any()
    detail.Pack(info)
    status = status_pb2.Status(code=err.grpc_code.value[0], message=err.message, details=[detail])
    return rpc_status.to_status(status)


def from_rpc_error(exc: grpc.RpcError) -> MeshError:
    """The domain error behind a failed RPC (reason kept when the server sent one)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    message = exc.details() if hasattr(exc, "details") else str(exc)
    cls = _BY_CODE.get(code, Internal)
    reason = None
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except Exception:  # pragma: no cover - malformed trailers
        status = None
    if status is not None:
        for detail in status.details:
            info = error_details_pb2.ErrorInfo()
            if detail.Unpack(info):
                reason = info.reason
    return cls(message or code.name, reason=reason)


T = TypeVar("T")


async def call(aw: Awaitable[T]) -> T:
    """Awaits a gRPC call; a failure comes back as the domain error behind it (MeshError)."""
    try:
        return await aw
    except grpc.aio.AioRpcError as exc:
        raise from_rpc_error(exc) from exc


async def _abort(context: grpc.aio.ServicerContext, err: MeshError) -> None:
    await context.abort_with_status(to_status(err))


F = TypeVar("F", bound=Callable[..., Any])


def grpc_errors(fn: F) -> F:
    """Servicer method decorator: MeshError (or a downstream AioRpcError) -> its gRPC status; anything
    else -> INTERNAL without a trace."""
    if inspect.isasyncgenfunction(fn):

        @functools.wraps(fn)
        async def gen_wrapper(
            self: Any, request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            try:
                async for item in fn(self, request, context):
                    yield item
            except MeshError as err:
                await _abort(context, err)
            except grpc.aio.AioRpcError as exc:  # a downstream service's error keeps its code
                await _abort(context, from_rpc_error(exc))
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("unhandled error in %s", fn.__qualname__)
                await _abort(context, Internal("internal error"))

        return gen_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except MeshError as err:
            await _abort(context, err)
        except grpc.aio.AioRpcError as exc:  # a downstream service's error keeps its code
            await _abort(context, from_rpc_error(exc))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unhandled error in %s", fn.__qualname__)
            await _abort(context, Internal("internal error"))

    return wrapper  # type: ignore[return-value]


__all__ = [
    "AlreadyExists",
    "Cancelled",
    "DeadlineExceeded",
    "FailedPrecondition",
    "Internal",
    "InvalidArgument",
    "MeshError",
    "NotFound",
    "ResourceExhausted",
    "Unauthenticated",
    "Unavailable",
    "call",
    "from_rpc_error",
    "grpc_errors",
    "to_status",
]
