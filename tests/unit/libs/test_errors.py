"""libs.errors: one table from REASON to gRPC status, HTTP status and event code, and errors that keep
their class across a gRPC hop (by the ErrorInfo reason, not by a guess from the status code)."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import errors
from agentmesh.libs.errors import (
    TABLE,
    Cancelled,
    DeadlineExceeded,
    Internal,
    MeshError,
    ModelError,
    ModelTimeout,
    NotFound,
    code_from_name,
    code_name,
    from_event,
    from_rpc_error,
    to_status,
)

CLASSES = [
    c
    for c in vars(errors).values()
    if isinstance(c, type) and issubclass(c, MeshError) and c is not MeshError
]


class _Failed(grpc.aio.AioRpcError):
    """What a client sees when a server aborted with `status` (the real AioRpcError, built directly)."""

    def __init__(self, status: grpc.Status) -> None:
        super().__init__(
            status.code, grpc.aio.Metadata(), grpc.aio.Metadata(*status.trailing_metadata), status.details
        )


def test_every_reason_has_a_class_and_a_row() -> None:
    assert {c.reason for c in CLASSES} == set(TABLE)
    for cls in CLASSES:
        row = TABLE[cls.reason]
        err = cls("x")
        assert (err.grpc_code, err.http_status, err.code) == (row.grpc, row.http, row.code)
        assert err.code != ev.ERROR_CODE_UNSPECIFIED


@pytest.mark.parametrize("cls", CLASSES)
def test_an_error_keeps_its_class_and_message_across_a_hop(cls: type[MeshError]) -> None:
    back = from_rpc_error(_Failed(to_status(cls("it broke"))))
    assert type(back) is cls and back.message == "it broke"


def test_model_errors_are_not_recognised_by_their_text() -> None:
    assert from_rpc_error(_Failed(to_status(ModelError("HTTP 500")))).code_name == "model_error"
    assert from_rpc_error(_Failed(to_status(ModelTimeout("slow")))).code_name == "timeout"
    assert DeadlineExceeded("x").code_name == "timeout"


def test_a_foreign_status_maps_by_code() -> None:
    plain = grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    assert isinstance(from_rpc_error(plain), NotFound)
    odd = grpc.aio.AioRpcError(grpc.StatusCode.DATA_LOSS, grpc.aio.Metadata(), grpc.aio.Metadata(), "")
    assert isinstance(from_rpc_error(odd), Internal) and from_rpc_error(odd).message == "internal error"


def test_grpc_words_stay_out_of_the_message() -> None:
    """Issue 39, point 5: the transport's details (an address, "Connection refused") reached users and
    were stored in assistant messages; they go to the log."""
    refused = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:50313: Connection refused"
    )
    down = grpc.aio.AioRpcError(
        grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), refused
    )
    err = from_rpc_error(down)
    assert isinstance(err, errors.Unavailable)
    assert err.message == "a service of the mesh is unavailable; try again shortly"
    crashed = grpc.aio.AioRpcError(
        grpc.StatusCode.UNKNOWN,
        grpc.aio.Metadata(),
        grpc.aio.Metadata(),
        "Exception calling application: boom",
    )
    assert from_rpc_error(crashed).message == "internal error"
    assert errors.as_mesh_error(KeyError("secret_field")).message == "internal error"


def test_a_send_the_call_ended_under_is_unavailable() -> None:
    """grpc.aio's INTERNAL for a send that failed as the call ended (its connection killed, or the
    server's end racing it) is no error of ours: unavailable, try again; any other INTERNAL stays."""
    lost = grpc.aio.AioRpcError(
        grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), errors.LOST_SEND
    )
    assert isinstance(from_rpc_error(lost), errors.Unavailable)
    other = grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(), "boom")
    assert isinstance(from_rpc_error(other), errors.Internal)


def test_status_carries_error_info() -> None:
    built = to_status(Cancelled("stop"))
    assert built.code == grpc.StatusCode.CANCELLED and built.details == "stop"
    status = rpc_status.from_call(_Failed(built))  # type: ignore[arg-type]
    info = error_details_pb2.ErrorInfo()
    assert status is not None and status.details[0].Unpack(info)
    assert (info.reason, info.domain) == ("CANCELLED", errors.DOMAIN)


def test_event_codes_round_trip() -> None:
    for cls in CLASSES:
        err = cls("m")
        event = err.to_event()
        assert code_from_name(code_name(event.code)) == event.code
        again = from_event(event)
        assert again.code == err.code and again.message == "m"
    assert code_name(0) == "internal" and code_from_name("no-such-code") == ev.ERROR_CODE_INTERNAL
    assert Cancelled("x").json_body() == {"error": {"code": 499, "reason": "CANCELLED", "message": "x"}}
