"""MessageService: a thin gRPC adapter from protobuf to the MessageHandler, errors through the one table
(libs/errors.py). The acting user comes from the call's verified identity, never from the request; an
append of AppendMessageStream may carry an identity token of its own, verified as the call's is."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from agentmesh.libs.errors import InvalidArgument, MeshError, grpc_errors
from agentmesh.libs.identity import Principal, Signer, current, current_user, user_of
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.store.base import Append, MessageQuery
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import message_service_pb2_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext


def _parent(append: ms.MessageAppend) -> int | None:
    return append.parent_sequence if append.HasField("parent_sequence") else None


class MessageServicer(message_service_pb2_grpc.MessageServiceServicer):
    def __init__(self, messages: MessageHandler, signer: Signer) -> None:
        self.messages = messages
        self.signer = signer  # the server's (IdentityInterceptor): verifies the tokens of stream appends

    @grpc_errors
    async def AppendMessageStream(
        self, requests: AsyncIterator[ms.AppendMessageStreamRequest], context: Ctx
    ) -> AsyncIterator[ms.AppendMessageStreamResponse]:
        caller = current()  # the stream's verified identity
        async for request in requests:
            if not request.appends:
                append = request.append
                try:
                    message = await self.messages.append(user_of(caller), append.message, _parent(append))
                except MeshError as err:  # this append's error: the stream goes on
                    yield ms.AppendMessageStreamResponse(error_reason=err.reason, error_message=err.message)
                    continue
                yield ms.AppendMessageStreamResponse(message=message)
                continue
            yield await self._append_each(caller, request)

    async def _append_each(
        self, caller: Principal | None, request: ms.AppendMessageStreamRequest
    ) -> ms.AppendMessageStreamResponse:
        """A request of several appends: each as its token's verified user (or the stream's caller),
        handed to the handler together, answered in order (an append that fails fails alone)."""
        if request.HasField("append"):
            raise InvalidArgument("a request carries one append or several appends, not both")

        def verified(item: ms.StreamAppend) -> Append:  # as the server interceptor verifies the call's token
            owner = user_of(self.signer.verify(item.identity) if item.identity else caller)
            return Append(owner, item.append.message, _parent(item.append))

        results = await self.messages.append_each(request.appends, verified)
        resp = ms.AppendMessageStreamResponse()
        for r in results:
            if isinstance(r, MeshError):
                resp.results.add(error_reason=r.reason, error_message=r.message)
            else:
                resp.results.add(message=r)
        return resp

    @grpc_errors
    async def AppendMessages(
        self, request: ms.AppendMessagesRequest, context: Ctx
    ) -> ms.AppendMessagesResponse:
        parent = request.parent_sequence if request.HasField("parent_sequence") else None
        stored = await self.messages.append_finished(
            current_user(), request.trace_id, request.messages, parent
        )
        return ms.AppendMessagesResponse(messages=stored)

    @grpc_errors
    async def BeginTurn(self, request: ms.BeginTurnRequest, context: Ctx) -> ms.BeginTurnResponse:
        return await self.messages.begin_turn(current_user(), request)

    @grpc_errors
    async def UpdateMessage(self, request: ms.UpdateMessageRequest, context: Ctx) -> ms.UpdateMessageResponse:
        paths = list(request.update_mask.paths)
        message = await self.messages.update(current_user(), request.message, paths)
        return ms.UpdateMessageResponse(message=message)

    @grpc_errors
    async def GetMessage(self, request: ms.GetMessageRequest, context: Ctx) -> ms.GetMessageResponse:
        return ms.GetMessageResponse(message=await self.messages.get(current_user(), request.message_id))

    @grpc_errors
    async def ListMessages(self, request: ms.ListMessagesRequest, context: Ctx) -> ms.ListMessagesResponse:
        query = MessageQuery(
            trace_id=request.trace_id,
            mode=request.mode,
            head_sequence=request.head_sequence,
            since_sequence=request.since_sequence,
            limit=request.limit,
            offset=request.offset,
        )
        page = await self.messages.list(current_user(), query, request.view)
        resp = ms.ListMessagesResponse(
            messages=page.messages, head_sequence=page.head_sequence, total=page.total, stale=page.stale
        )
        if page.sync_time is not None:
            resp.sync_time.FromDatetime(page.sync_time)
        return resp
