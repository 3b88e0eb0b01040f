"""gRPC clients of the mesh services: one channel per target, every RPC with a deadline."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from agentmesh.v1 import (
    agent_runtime_service_pb2_grpc,
    orchestrator_service_pb2_grpc,
    stream_service_pb2_grpc,
    trace_service_pb2_grpc,
)
from libs.config import MeshSettings
from libs.rpc import channel


@dataclass
class Clients:
    """Stubs for the four services. Build with `Clients.connect(settings)`; close with `close()`."""

    trace: trace_service_pb2_grpc.TraceServiceStub
    stream: stream_service_pb2_grpc.StreamServiceStub
    orchestrator: orchestrator_service_pb2_grpc.OrchestratorServiceStub
    runtime: agent_runtime_service_pb2_grpc.AgentRuntimeServiceStub
    channels: list[grpc.aio.Channel] = field(default_factory=list)

    @classmethod
    def connect(cls, settings: MeshSettings) -> Clients:
        cache: dict[str, grpc.aio.Channel] = {}

        def ch(target: str) -> grpc.aio.Channel:
            if target not in cache:
                cache[target] = channel(target, settings.rpc_timeout_s, settings.stream_rpc_timeout_s)
            return cache[target]

        a = settings.addresses
        return cls(
            trace=trace_service_pb2_grpc.TraceServiceStub(ch(a.trace)),
            stream=stream_service_pb2_grpc.StreamServiceStub(ch(a.stream)),
            orchestrator=orchestrator_service_pb2_grpc.OrchestratorServiceStub(ch(a.orchestrator)),
            runtime=agent_runtime_service_pb2_grpc.AgentRuntimeServiceStub(ch(a.agent_runtime)),
            channels=list(cache.values()),
        )

    async def close(self) -> None:
        for ch in self.channels:
            await ch.close()
