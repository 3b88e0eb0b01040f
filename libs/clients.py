"""gRPC clients of the mesh services: one channel per target, opened on first use, every RPC with a
deadline and the acting principal's identity (libs.rpc.channel)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, TypeVar

import grpc

from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.leases.v1 import lease_service_pb2_grpc
from agentmesh.libs import identity
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import DeadlineExceeded, MeshError, Unavailable, from_reason, from_rpc_error
from agentmesh.libs.identity import Signer, signer_for
from agentmesh.libs.peer_http import PeerClients
from agentmesh.libs.peers import PeerRegistry
from agentmesh.libs.rpc import channel, end_call_soon
from agentmesh.libs.streams.follower import Follower
from agentmesh.libs.streams.reconnect import Reconnect
from agentmesh.libs.streams.writer import Writer
from agentmesh.orchestrator.v1 import orchestrator_service_pb2_grpc
from agentmesh.runtime.v1 import runtime_service_pb2_grpc
from agentmesh.stream.v1 import stream_service_pb2_grpc
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import (
    message_service_pb2_grpc,
    subagent_service_pb2_grpc,
    task_service_pb2_grpc,
    trace_service_pb2_grpc,
)
from agentmesh.trace.v1 import trace_pb2 as tp

T = TypeVar("T")


@dataclass
class Peers:
    registry: PeerRegistry
    http: PeerClients


class Clients:
    """Stubs of every service. Channels open lazily from `settings.addresses` as they are at first use
    (a test may bind its servers on port 0 first, then fill in the addresses); close with `close()`."""

    def __init__(self, settings: MeshSettings, signer: Signer | None = None) -> None:
        self.settings = settings
        self.signer = signer or signer_for(settings)
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, target: str) -> grpc.aio.Channel:
        if target not in self._channels:
            s = self.settings
            self._channels[target] = channel(target, self.signer, s.rpc_timeout_s, s.stream_rpc_timeout_s)
        return self._channels[target]

    @cached_property
    def trace(self) -> trace_service_pb2_grpc.TraceServiceStub:
        """Traces (the trace process serves traces, messages, tasks, subagents, agents, keys, leases)."""
        return trace_service_pb2_grpc.TraceServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def messages(self) -> message_service_pb2_grpc.MessageServiceStub:
        return message_service_pb2_grpc.MessageServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def tasks(self) -> task_service_pb2_grpc.TaskServiceStub:
        return task_service_pb2_grpc.TaskServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def subagents(self) -> subagent_service_pb2_grpc.SubagentServiceStub:
        return subagent_service_pb2_grpc.SubagentServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def agents(self) -> agent_service_pb2_grpc.AgentServiceStub:
        return agent_service_pb2_grpc.AgentServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def auth(self) -> auth_service_pb2_grpc.AuthServiceStub:
        return auth_service_pb2_grpc.AuthServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def leases(self) -> lease_service_pb2_grpc.LeaseServiceStub:
        return lease_service_pb2_grpc.LeaseServiceStub(self.channel(self.settings.addresses.trace))

    @cached_property
    def stream(self) -> stream_service_pb2_grpc.StreamServiceStub:
        return stream_service_pb2_grpc.StreamServiceStub(self.channel(self.settings.addresses.stream))

    @cached_property
    def follows(self) -> Follower:
        """Follows of stream buffers, every one of this process on one FollowStreams call."""
        life_s = self.settings.stream_rpc_timeout_s / 2
        return Follower(lambda: self.stream, self.signer, life_s, self._reconnect())

    @cached_property
    def writes(self) -> Writer:
        """Writes to stream buffers (EventSinks), every one of this process on one WriteStreams call."""
        life_s = self.settings.stream_rpc_timeout_s / 2
        return Writer(lambda: self.stream, life_s, self.settings.stream.linger_ms / 1000, self._reconnect())

    def _reconnect(self) -> Reconnect:
        """The wait for the stream service, after a call to it failed as it went away."""
        return Reconnect(
            lambda: self.channel(self.settings.addresses.stream).channel_ready(),
            self.settings.stream.reconnect_s,
        )

    @cached_property
    def orchestrator(self) -> orchestrator_service_pb2_grpc.OrchestratorServiceStub:
        target = self.settings.addresses.orchestrator
        return orchestrator_service_pb2_grpc.OrchestratorServiceStub(self.channel(target))

    @cached_property
    def runtime(self) -> runtime_service_pb2_grpc.AgentRuntimeServiceStub:
        target = self.settings.addresses.agent_runtime
        return runtime_service_pb2_grpc.AgentRuntimeServiceStub(self.channel(target))

    @cached_property
    def peers(self) -> Peers:
        """The peer registry (AGENTMESH_PEERS) and an HTTP client per peer, for calls to other meshes."""
        return Peers(PeerRegistry.load(self.settings.peers), PeerClients(self.settings.federation))

    async def close(self) -> None:
        if "peers" in self.__dict__:
            await self.peers.http.close()
        if "follows" in self.__dict__:
            await self.follows.aclose()
        if "writes" in self.__dict__:
            await self.writes.aclose()
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            await ch.close()


class AskCall:
    """A bidirectional call driven one request and one answer at a time: `ask` puts a request and
    reads the next answer. gRPC takes the requests from an iterator over a queue (`drain`), read in
    one task of its own (`call.write` would start tasks per message)."""

    def __init__(self, method: Callable[[AsyncIterator[Any]], Any]) -> None:
        self._requests: asyncio.Queue[Any] = asyncio.Queue()
        self.call = method(drain(self._requests))

    def done(self) -> bool:
        return bool(self.call.done())

    async def ask(self, request: Any) -> Any:
        """The answer to `request`: grpc.aio.EOF when the call ended first without an error, the call's
        AioRpcError when it failed."""
        self._requests.put_nowait(request)
        return await self.call.read()

    async def end(self, timeout_s: float) -> None:
        """Half-closes and reads the call to its end (a bounded while), so that what wraps its answers
        (a tracing span) ends too; every request was answered, so how it ends changes nothing."""
        self._requests.put_nowait(None)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                while await self.call.read() is not grpc.aio.EOF:
                    pass
        self.call.cancel()

    def cancel(self) -> None:
        """Ends the call (when it still runs) and the request reader, which waits on the queue even
        after the call ended; the call is read to its end in the background (`end_call_soon`)."""
        self._requests.put_nowait(None)
        end_call_soon(self.call)


MAX_STREAM_APPENDS = 500  # appends per AppendMessageStream request (the trace service's limit)


@dataclass(eq=False)
class _Queued:
    """An append waiting for its request: what goes in it and where its answer goes."""

    message: tp.Message
    parent_sequence: int | None
    identity: str  # the acting user's token; empty: the stream's caller
    answer: asyncio.Future[tp.Message]


@dataclass(eq=False)
class _Lane:
    """One AppendMessageStream of an appender and the task sending on it (None: idle)."""

    call: AskCall | None = None
    sender: asyncio.Task[None] | None = None


class MessageAppender:
    """Appends messages on `AppendMessageStream`s, for any number of concurrent writers of a process:
    a fraction of a unary call each. Each of its `lanes` (streams) has one request in flight
    at a time, carrying every append that queued meanwhile (at most 500): an append that finds a lane
    idle goes at once, and a crowd of writers costs one message each way per round trip. Two lanes let
    one request's answer be written and read while the other's appends are stored (the writers'
    process, the trace service and the database work at once). Appends made one after another keep
    their order; appends made concurrently have none to keep.

    With a `signer`, each append carries a token of the principal acting when it was made (the stream
    itself opens as the mesh), so writers acting as different users share one stream. Without one, the
    stream opens as the principal acting at the append that opened it, the caller of every append on
    it: then one appender serves one user.

    Each append waits for its answer (at most `timeout_s`); a failed append raises its `MeshError` and
    the stream goes on; a stream that ended (the service restarted, the deadline) fails every append in
    flight with its error, and the next request opens a new one."""

    def __init__(
        self,
        stub: message_service_pb2_grpc.MessageServiceStub,
        timeout_s: float = 10.0,
        signer: Signer | None = None,
        lanes: int = 2,
    ) -> None:
        self._stub = stub
        self._timeout_s = timeout_s
        self._signer = signer
        self._queue: list[_Queued] = []
        self._lanes = [_Lane() for _ in range(max(1, lanes))]
        self._takers = 0  # lanes about to take from the queue: each takes its share

    async def append(self, message: tp.Message, parent_sequence: int | None = None) -> tp.Message:
        token = ""
        if self._signer is not None:
            principal = identity.current()
            if principal is not None and not principal.is_mesh:
                token = self._signer.mint(principal.user)
        answer: asyncio.Future[tp.Message] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(message, parent_sequence, token, answer))
        idle = next((lane for lane in self._lanes if lane.sender is None), None)
        if idle is not None:
            self._takers += 1
            idle.sender = asyncio.create_task(self._send(idle))
        try:
            async with asyncio.timeout(self._timeout_s):
                return await answer  # cancelled by the timeout: a request not sent yet leaves it out
        except TimeoutError:
            raise self._late() from None

    def _late(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no answer to an append within {self._timeout_s:g} s")

    async def _send(self, lane: _Lane) -> None:
        """Sends what queued on `lane`, a request at a time, until nothing is left."""
        try:
            while True:
                live = [q for q in self._queue if not q.answer.done()]  # done: its writer gave up
                share = min(MAX_STREAM_APPENDS, -(-len(live) // max(1, self._takers)))
                self._takers -= 1
                batch, self._queue = live[:share], live[share:]
                if not batch:
                    return
                await self._ask(lane, batch)
                self._takers += 1
        finally:
            lane.sender = None

    async def _ask(self, lane: _Lane, batch: list[_Queued]) -> None:
        request = ms.AppendMessageStreamRequest()
        for q in batch:
            item = request.appends.add(identity=q.identity)
            item.append.message.CopyFrom(q.message)
            if q.parent_sequence is not None:
                item.append.parent_sequence = q.parent_sequence
        if lane.call is None:
            with identity.acting_as("") if self._signer is not None else contextlib.nullcontext():
                lane.call = AskCall(self._stub.AppendMessageStream)
        failed: MeshError | None = None
        try:
            async with asyncio.timeout(self._timeout_s):
                resp = await lane.call.ask(request)
        except TimeoutError:
            failed = self._late()
        except grpc.aio.AioRpcError as exc:
            failed = from_rpc_error(exc)
        else:
            if resp is grpc.aio.EOF:
                failed = Unavailable("the trace service ended the append stream")
            elif len(resp.results) != len(batch):
                failed = Unavailable("the trace service answered an append request malformed")
        if failed is not None:
            if lane.call is not None:
                lane.call.cancel()
                lane.call = None
            for q in batch:
                if not q.answer.done():  # an error of its own for each writer
                    q.answer.set_exception(from_reason(failed.reason, failed.message))
            return
        for q, result in zip(batch, resp.results, strict=True):
            if q.answer.done():
                continue
            if result.error_reason:
                q.answer.set_exception(from_reason(result.error_reason, result.error_message))
            else:
                q.answer.set_result(result.message)

    async def aclose(self) -> None:
        """Waits for the appends queued, then ends the streams (appends already answered are stored)."""
        senders = [lane.sender for lane in self._lanes if lane.sender is not None]
        if senders:
            await asyncio.wait(senders)
        calls = [lane.call for lane in self._lanes if lane.call is not None]
        for lane in self._lanes:
            lane.call = None
        await asyncio.gather(*(call.end(self._timeout_s) for call in calls))


async def drain(queue: asyncio.Queue[T | None]) -> AsyncIterator[T]:
    """The queue's items until a None: the requests of a client-streaming call that a writer puts
    one by one (gRPC reads them in one task of its own, where `call.write` starts tasks per message)."""
    while (item := await queue.get()) is not None:
        yield item
