"""gRPC plumbing shared by every service: the server lifecycle and client channels with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


@dataclass
class Registration:
    """One servicer to mount: the generated `add_XServicer_to_server` and its full service name."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str


@dataclass
class ServiceServer:
    """A grpc.aio server with health and reflection; `stop` drains in-flight RPCs within a grace."""

    registrations: Sequence[Registration]
    address: str = "127.0.0.1:0"
    grace_s: float = 10.0
    on_stop: list[Callable[[], Any]] = field(default_factory=list)
    port: int = 0
    stop_grace_s: float = 0.0  # the grace of the stop under way, for on_stop hooks

    def __post_init__(self) -> None:
        self.server = grpc.aio.server(options=_CHANNEL_OPTIONS)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [reflection.SERVICE_NAME, health.SERVICE_NAME]
        for reg in self.registrations:
            reg.add(reg.servicer, self.server)
            names.append(reg.name)
        reflection.enable_server_reflection(names, self.server)
        self._stopped = asyncio.Event()

    @property
    def target(self) -> str:
        host = self.address.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    async def start(self) -> ServiceServer:
        self.port = self.server.add_insecure_port(self.address)
        if not self.port:
            raise RuntimeError(f"cannot bind {self.address}")
        await self.server.start()
        for reg in self.registrations:
            await self.health.set(reg.name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info("serving", extra={"address": self.target})
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then stop taking RPCs and let in-flight ones finish within the grace;
        then the on_stop hooks (drain background work, close clients), each bounded by the grace."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.stop_grace_s = grace_s if grace_s is not None else self.grace_s
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        for hook in self.on_stop:
            result = hook()
            if asyncio.iscoroutine(result):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(result, grace + 10)
        log.info("stopped", extra={"address": self.target})

    async def serve_until_signal(self) -> None:
        """Runs until SIGTERM or SIGINT, then shuts down gracefully."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received, draining", extra={"grace_s": self.grace_s})
        await self.stop()


class _Deadline:
    """Sets `timeout` on a call that has none."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if details.timeout is not None:
            return details
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=self.timeout_s,
            metadata=details.metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


# grpc.aio files an interceptor under the first kind it is an instance of, so one class per kind.
class _UnaryUnaryDeadline(_Deadline, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request)


class _UnaryStreamDeadline(_Deadline, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request)


class _StreamUnaryDeadline(_Deadline, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request_iterator)


class _StreamStreamDeadline(_Deadline, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request_iterator)


def channel(target: str, unary_timeout_s: float = 10.0, stream_timeout_s: float = 3600.0) -> grpc.aio.Channel:
    """An insecure loopback/cluster channel whose RPCs always carry a deadline."""
    return grpc.aio.insecure_channel(
        target,
        options=_CHANNEL_OPTIONS,
        interceptors=[
            _UnaryUnaryDeadline(unary_timeout_s),
            _UnaryStreamDeadline(stream_timeout_s),
            _StreamUnaryDeadline(unary_timeout_s),
            _StreamStreamDeadline(stream_timeout_s),
        ],
    )


async def wait_serving(target: str, timeout_s: float = 20.0, service: str = "") -> None:
    """Waits (health Watch, wait_for_ready) until the target reports SERVING, or raises TimeoutError."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            async for resp in stub.Watch(request, wait_for_ready=True, timeout=timeout_s):
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            raise TimeoutError(
                f"{target} did not report SERVING within {timeout_s}s: {exc.code().name}"
            ) from exc
        raise TimeoutError(f"{target} stopped before it was SERVING")
