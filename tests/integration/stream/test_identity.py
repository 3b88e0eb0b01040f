"""Who may use a stream buffer: every StreamService call carries a verified identity (libs/rpc.py
IdentityInterceptor), a buffer belongs to the user who created it, and another user's buffer reads
exactly like a missing one. The mesh's own principal reads any buffer but creates none."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import MeshError
from agentmesh.libs.identity import Signer
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc
from tests.conftest import TEST_SECRET
from tests.integration.stream.conftest import StreamHarness, append, close, collect, create, deltas, info

Call = Callable[[stream_service_pb2_grpc.StreamServiceStub, str, Any], Awaitable[Any]]


async def _sent(call: Any, request: Any) -> Any:
    """`call` (a client-streaming one) with `request` written only if the call goes on: a call the
    server refuses ends at once, and is left unwritten (grpc.aio turns a write that races the refusal
    into INTERNAL, hiding the server's status). A call that is not refused waits for its requests: after
    a bounded wait it is written to, and the test sees it succeed."""
    ended = asyncio.ensure_future(call.code())
    await asyncio.wait({ended}, timeout=5)
    if not ended.done():
        await call.write(request)
        await call.done_writing()
    return call


async def _write_streams(stub: stream_service_pb2_grpc.StreamServiceStub, key: str, metadata: Any) -> Any:
    batch = pb.StreamBatch(writer=1, batch=pb.WriteStreamRequest(key=key, events=deltas("x")), last=True)
    request = pb.WriteStreamsRequest(batches=[batch])
    return [r async for r in await _sent(stub.WriteStreams(metadata=metadata), request)]


async def _follow_streams(stub: stream_service_pb2_grpc.StreamServiceStub, key: str, metadata: Any) -> Any:
    subscription = pb.SubscribeStreamRequest(key=key, idle_timeout_ms=200)
    request = pb.FollowStreamsRequest(follows=[pb.StreamFollow(id=1, subscription=subscription)])
    return [r async for r in await _sent(stub.FollowStreams(metadata=metadata), request)]


RPCS: dict[str, Call] = {
    "CreateStream": lambda s, k, m: s.CreateStream(pb.CreateStreamRequest(key=k), metadata=m),
    "AppendEvents": lambda s, k, m: s.AppendEvents(
        pb.AppendEventsRequest(key=k, events=deltas("x")), metadata=m
    ),
    "WriteStreams": _write_streams,
    "CloseStream": lambda s, k, m: s.CloseStream(
        pb.CloseStreamRequest(key=k, done=ev.StreamDone()), metadata=m
    ),
    "FollowStreams": _follow_streams,
    "GetStreamInfo": lambda s, k, m: s.GetStreamInfo(pb.GetStreamInfoRequest(key=k), metadata=m),
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _forged(kind: str) -> str:
    """An identity token the stream service must refuse."""
    if kind == "other-secret":
        return Signer(b"not-the-mesh-secret-0123456789").mint("alice")
    if kind == "expired":  # minted an hour ago with the right secret (5 min life, 30 s leeway)
        return Signer(TEST_SECRET.encode(), clock=lambda: time.time() - 3600).mint("alice")
    if kind == "tampered":  # a valid token of bob's with its claims rewritten to alice
        version, claims, signature = Signer(TEST_SECRET.encode()).mint("bob").split(".")
        data = json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))
        return ".".join([version, _b64(json.dumps({**data, "u": "alice"}).encode()), signature])
    if kind == "unsigned":
        return "v1." + _b64(json.dumps({"u": "alice", "exp": int(time.time()) + 60}).encode()) + "."
    if kind == "garbage":
        return "x" * 5000
    raise AssertionError(kind)


@pytest.fixture
async def raw_channel(stream: StreamHarness) -> AsyncIterator[grpc.aio.Channel]:
    """A plain channel: no identity unless a test puts one in the metadata itself."""
    async with grpc.aio.insecure_channel(stream.server.target) as ch:
        yield ch


@pytest.fixture
def raw_stub(raw_channel: grpc.aio.Channel) -> stream_service_pb2_grpc.StreamServiceStub:
    return stream_service_pb2_grpc.StreamServiceStub(raw_channel)


async def _code(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("rpc", list(RPCS))
async def test_call_without_identity_is_unauthenticated(
    stream: StreamHarness, raw_stub: stream_service_pb2_grpc.StreamServiceStub, unique: str, rpc: str
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    before = await info(stream, key)
    assert await _code(RPCS[rpc](raw_stub, key, None)) == grpc.StatusCode.UNAUTHENTICATED
    assert await info(stream, key) == before  # nothing changed
    assert stream.backend.subscribers == 0


@pytest.mark.parametrize("forgery", ["other-secret", "expired", "tampered", "unsigned", "garbage"])
@pytest.mark.parametrize("rpc", list(RPCS))
async def test_forged_identity_is_unauthenticated(
    stream: StreamHarness,
    raw_stub: stream_service_pb2_grpc.StreamServiceStub,
    unique: str,
    rpc: str,
    forgery: str,
) -> None:
    key = f"trace:{unique}"
    await create(stream, key)
    before = await info(stream, key)
    metadata = ((identity.HEADER, _forged(forgery)),)
    assert await _code(RPCS[rpc](raw_stub, key, metadata)) == grpc.StatusCode.UNAUTHENTICATED
    assert await info(stream, key) == before


async def test_health_needs_no_identity(raw_channel: grpc.aio.Channel) -> None:
    resp = await health_pb2_grpc.HealthStub(raw_channel).Check(health_pb2.HealthCheckRequest())
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_the_signed_identity_is_the_owner(
    stream: StreamHarness, raw_stub: stream_service_pb2_grpc.StreamServiceStub, unique: str
) -> None:
    """A token minted with the mesh secret, sent by hand, works like the channel's own signing."""
    key = f"trace:{unique}"
    token = Signer(TEST_SECRET.encode()).mint("carol")
    await raw_stub.CreateStream(pb.CreateStreamRequest(key=key), metadata=((identity.HEADER, token),))
    assert (await info(stream, key, reader="carol")).exists
    assert not (await info(stream, key, reader="alice")).exists


async def test_create_by_the_mesh_principal_is_unauthenticated(stream: StreamHarness, unique: str) -> None:
    key = f"trace:{unique}"
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.stub.CreateStream(pb.CreateStreamRequest(key=key))  # outside acting_as: the mesh
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "needs a user" in (err.value.details() or "")
    assert not (await info(stream, key)).exists
    with pytest.raises(grpc.aio.AioRpcError) as explicit:
        await create(stream, key, owner="")  # acting_as("") is the mesh too
    assert explicit.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize("closed", [False, True], ids=["open", "closed"])
async def test_a_user_cannot_read_another_users_buffer(
    stream: StreamHarness, unique: str, closed: bool
) -> None:
    key = f"trace:{unique}"
    await create(stream, key, owner="alice")
    offsets = await append(stream, key, deltas("secret"))
    if closed:
        offsets.append((await close(stream, key)).offset)

    missing = await info(stream, f"trace:{unique}-none", reader="bob")
    foreign = await info(stream, key, reader="bob")
    assert (
        foreign == missing == pb.GetStreamInfoResponse()
    )  # exists=false and nothing else: like a missing key
    for kw in ({}, {"from_offset": offsets[0]}, {"terminal_only": True}):
        with pytest.raises(MeshError) as err:
            await collect(stream, key, reader="bob", idle_timeout_ms=100, **kw)
        assert err.value.grpc_code == grpc.StatusCode.NOT_FOUND
        assert err.value.message == f"no stream buffer {key}"  # the same answer as for a missing key
    assert stream.backend.subscribers == 0

    own = await info(stream, key, reader="alice")
    assert (own.exists, own.closed, own.last_offset) == (True, closed, offsets[-1])
    assert await info(stream, key) == own  # the mesh reads any buffer
    if closed:
        for reader in ("alice", ""):
            got = await collect(stream, key, reader=reader)
            assert [e.offset for e in got] == offsets


async def test_a_user_cannot_write_another_users_buffer(stream: StreamHarness, unique: str) -> None:
    """Appends and closes by another user answer like a missing key; the owner and the mesh may write;
    a closed buffer of one user cannot be taken over by another."""
    key = f"a2a:{unique}"
    await create(stream, key, owner="alice")
    with identity.acting_as("bob"):
        for call in (
            stream.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=deltas("forged"))),
            stream.stub.CloseStream(pb.CloseStreamRequest(key=key, done=ev.StreamDone())),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.NOT_FOUND,
                f"no stream buffer {key}",
            )
    with identity.acting_as("alice"):
        await stream.stub.AppendEvents(pb.AppendEventsRequest(key=key, events=deltas("mine")))
    await append(stream, key, deltas(" and the mesh's"))  # the mesh itself
    await close(stream, key)
    got = await collect(stream, key, reader="alice")
    assert "".join(e.text_delta.text_delta for e in got) == "mine and the mesh's"  # no forged text
    with identity.acting_as("bob"), pytest.raises(grpc.aio.AioRpcError) as err:
        await stream.stub.CreateStream(pb.CreateStreamRequest(key=key))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    await create(stream, key, owner="alice")  # its owner may start it again
