"""StreamService over gRPC: a thin adapter from protobuf to a `StreamBackend`."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import InvalidArgument, PermissionDenied, grpc_errors
from agentmesh.libs.events import is_terminal
from agentmesh.libs.identity import Signer
from agentmesh.services.stream.backend import StreamBackend
from agentmesh.services.stream.mux import FollowCall, UserOf, WriteCall
from agentmesh.stream.v1 import stream_service_pb2 as pb
from agentmesh.stream.v1 import stream_service_pb2_grpc

MAX_DELETE = 10_000  # keys per DeleteStreams / RenewStreams
MAX_BATCH_CREATE = 100  # buffers per BatchCreateStreams


def _reader() -> str:
    """The verified caller: a user reads and writes only their own buffers; the mesh itself ("") any."""
    principal = identity.current()
    return principal.user if principal is not None else ""


class StreamServicer(stream_service_pb2_grpc.StreamServiceServicer):
    """Each RPC is one backend call; the buffer's owner and reader come from the call's identity (or,
    for a follow or a writer of the calls that carry many, from its own token, verified alike)."""

    def __init__(self, backend: StreamBackend, signer: Signer) -> None:
        self.backend = backend
        self.signer = signer  # the server's (IdentityInterceptor): verifies the tokens of follows, writers

    def _user_of(self) -> UserOf:
        """A follow's or a writer's user from its identity token; an empty token: the call's caller."""
        caller = _reader()
        return lambda token: self.signer.verify(token).user if token else caller

    async def _create(self, request: pb.CreateStreamRequest) -> pb.CreateStreamResponse:
        if any(is_terminal(event) for event in request.events):
            raise InvalidArgument("a buffer is not born ended: CreateStream's events are none terminal")
        owner = identity.current_user()
        await self.backend.create(request.key, owner, dict(request.metadata))
        offsets = await self.backend.append(request.key, request.events, owner) if request.events else []
        return pb.CreateStreamResponse(offsets=offsets)

    @grpc_errors
    async def CreateStream(
        self, request: pb.CreateStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.CreateStreamResponse:
        return await self._create(request)

    @grpc_errors
    async def BatchCreateStreams(
        self, request: pb.BatchCreateStreamsRequest, context: grpc.aio.ServicerContext
    ) -> pb.BatchCreateStreamsResponse:
        if len(request.requests) > MAX_BATCH_CREATE:
            raise InvalidArgument(f"at most {MAX_BATCH_CREATE} buffers at once")
        return pb.BatchCreateStreamsResponse(responses=[await self._create(r) for r in request.requests])

    @grpc_errors
    async def AppendEvents(
        self, request: pb.AppendEventsRequest, context: grpc.aio.ServicerContext
    ) -> pb.AppendEventsResponse:
        return pb.AppendEventsResponse(
            offsets=await self.backend.append(request.key, request.events, _reader(), request.since)
        )

    @grpc_errors
    async def WriteStreams(
        self, request: AsyncIterator[pb.WriteStreamsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WriteStreamsResponse]:
        writers = WriteCall(self.backend, self._user_of())
        try:
            async for response in writers.responses(request):
                yield response
        finally:
            writers.close()

    @grpc_errors
    async def CloseStream(
        self, request: pb.CloseStreamRequest, context: grpc.aio.ServicerContext
    ) -> pb.CloseStreamResponse:
        outcome = request.WhichOneof("outcome")
        if outcome == "done":
            terminal = ev.Event(done=request.done)
        elif outcome == "error":
            terminal = ev.Event(error=request.error)
        else:
            raise InvalidArgument("CloseStream needs an outcome: done or error")
        if any(is_terminal(event) for event in request.events):
            raise InvalidArgument("CloseStream's events come before its outcome: none of them terminal")
        offsets, offset, closed = await self.backend.end(
            request.key, request.events, terminal, _reader(), request.since
        )
        return pb.CloseStreamResponse(offset=offset, closed=closed, offsets=offsets)

    @grpc_errors
    async def FollowStreams(
        self, request: AsyncIterator[pb.FollowStreamsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.FollowStreamsResponse]:
        follows = FollowCall(self.backend, self._user_of())
        try:
            async for response in follows.responses(request):
                yield response
        finally:
            follows.close()

    @grpc_errors
    async def RenewStreams(
        self, request: pb.RenewStreamsRequest, context: grpc.aio.ServicerContext
    ) -> pb.RenewStreamsResponse:
        if _reader():
            raise PermissionDenied("stream leases are kept by the mesh itself, not on behalf of a user")
        if len(request.keys) > MAX_DELETE:
            raise InvalidArgument(f"at most {MAX_DELETE} keys at once")
        return pb.RenewStreamsResponse(renewed=await self.backend.renew(request.keys))

    @grpc_errors
    async def DeleteStreams(
        self, request: pb.DeleteStreamsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteStreamsResponse:
        if len(request.keys) > MAX_DELETE:
            raise InvalidArgument(f"at most {MAX_DELETE} keys at once")
        terminal = ev.Event(error=request.error)
        requester = _reader()
        deleted = 0
        for key in request.keys:
            deleted += await self.backend.delete(key, terminal, requester)
        return pb.DeleteStreamsResponse(deleted_count=deleted)

    @grpc_errors
    async def GetStreamInfo(
        self, request: pb.GetStreamInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetStreamInfoResponse:
        info = await self.backend.read_info(request.key, _reader())
        return pb.GetStreamInfoResponse(
            exists=info.exists,
            closed=info.closed,
            last_offset=info.last_offset,
            metadata=info.metadata,
            length=info.length,
        )
