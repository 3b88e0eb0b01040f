"""The JSON bound over gRPC (issue 39, point 4; libs/jsonbound.py): a message's metadata holding a number
that is not finite is INVALID_ARGUMENT on append and on update, on both databases alike; it was an
internal error ("Fail to serialize NaN for Value.number_value"). (Depth: protobuf's own decoding limit,
100 message levels, is about MAX_DEPTH levels of a Struct, so no deeper Struct can be sent at all.)"""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf import field_mask_pb2, struct_pb2

from agentmesh.libs import identity
from agentmesh.libs.jsonbound import MAX_DEPTH
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.integration.trace.conftest import append, new_trace

BAD = grpc.StatusCode.INVALID_ARGUMENT


def deep(levels: int) -> struct_pb2.Struct:
    value: dict = {}
    for _ in range(levels):
        value = {"a": value}
    out = struct_pb2.Struct()
    out.update(value)
    return out


def with_number(number: float) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update({"list": [1, {"n": number}]})
    return out


BEYOND = [
    pytest.param(with_number(math.nan), id="nan"),
    pytest.param(with_number(math.inf), id="inf"),
]


@pytest.mark.parametrize("metadata", BEYOND)
async def test_metadata_beyond_the_bound_is_invalid_argument(trace_stub, message_stub, unique, metadata):
    owner = f"u-{unique}"
    trace = await new_trace(trace_stub, owner)
    with pytest.raises(grpc.aio.AioRpcError) as appended:
        await append(message_stub, owner, trace.id, "x", metadata=metadata)
    assert appended.value.code() == BAD, appended.value.details()
    with identity.acting_as(owner):
        with pytest.raises(grpc.aio.AioRpcError) as batch:
            message = tp.Message(role=tp.MESSAGE_ROLE_USER, content="x", metadata=metadata)
            await message_stub.AppendMessages(ms.AppendMessagesRequest(trace_id=trace.id, messages=[message]))
    assert batch.value.code() == BAD, batch.value.details()
    stored = await append(message_stub, owner, trace.id, "fine")
    with identity.acting_as(owner):
        with pytest.raises(grpc.aio.AioRpcError) as updated:
            await message_stub.UpdateMessage(
                ms.UpdateMessageRequest(
                    message=tp.Message(id=stored.id, metadata=metadata),
                    update_mask=field_mask_pb2.FieldMask(paths=["metadata"]),
                )
            )
    assert updated.value.code() == BAD, updated.value.details()


async def test_metadata_within_the_bound_is_stored(trace_stub, message_stub, unique):
    owner = f"u-{unique}"
    trace = await new_trace(trace_stub, owner)
    stored = await append(message_stub, owner, trace.id, "x", metadata=deep(MAX_DEPTH - 4))
    assert stored.metadata == deep(MAX_DEPTH - 4)
