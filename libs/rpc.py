"""gRPC plumbing shared by every service: the server lifecycle and client channels with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from agentmesh.libs import aio, identity, telemetry
from agentmesh.libs.config import DRAIN_SETTLE_S
from agentmesh.libs.errors import Unauthenticated, to_status
from agentmesh.libs.identity import Signer
from agentmesh.libs.metrics import MetricsServer, Refresh, RpcMetrics, process_series

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
_SIZES = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
# Keepalive that clients and servers agree on: clients ping every 30 s (also when idle), servers
# accept pings 10 s apart, so idle channels stay up without GOAWAY too_many_pings.
KEEPALIVE_MS = 30_000
_CHANNEL_OPTIONS = [
    *_SIZES,
    # A restarted service is found again within a second, not after gRPC's default 1-120 s backoff.
    # (Not grpc.min_reconnect_backoff_ms: gRPC core takes it as the shortest time a connection attempt
    # is given to complete, 20 s unless set. At 100 ms, a busy server that answered a new connection's
    # handshake a little later failed every call of the channel UNAVAILABLE, "connection attempt timed
    # out before receiving SETTINGS frame": 34 of 1,000 turns in one run of scenario C.)
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
_SERVER_OPTIONS = [
    *_SIZES,
    # A port is owned: gRPC sets SO_REUSEPORT by default, and a second server on the same port (a
    # second mesh, a stale process) would bind without an error and take half of the connections.
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


def server_options(max_queued_s: float) -> list[tuple[str, Any]]:
    """The options of every grpc.aio server of a mesh process (the services', the gateway's A2A one).

    grpc.aio takes calls one at a time, one event-loop round trip each: with the loop saturated a
    burst of calls waits in gRPC core's queue of calls not yet taken, and core cancels one that waited
    longer than grpc.server_max_unrequested_time_in_server (default 30 s) with a bare CANCELLED, as if
    its caller had gone. `max_queued_s` bounds that wait instead (and the caller's deadline, if any)."""
    return [*_SERVER_OPTIONS, ("grpc.server_max_unrequested_time_in_server", max(1, round(max_queued_s)))]


class BindError(OSError):
    """A server could not listen on its address."""


@dataclass
class Registration:
    """One servicer to mount: the generated `add_XServicer_to_server` and its full service name."""

    add: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    name: str

    @classmethod
    def of(
        cls, pb2: Any, service: str, add: Callable[[Any, grpc.aio.Server], None], servicer: Any
    ) -> Registration:
        """`pb2` is the generated *_pb2 module that declares `service`."""
        return cls(add, servicer, pb2.DESCRIPTOR.services_by_name[service].full_name)


def server_settings(settings: Any, service: str) -> dict[str, Any]:
    """The ServiceServer arguments of `service` (orchestrator, agent_runtime, trace, stream) from the
    mesh settings: where it binds, its drain grace, its metrics address, its connection age."""
    return {
        "address": settings.listen_address(service),
        "grace_s": settings.shutdown_grace_s,
        "metrics_address": getattr(settings.metrics, service),
        "max_connection_age_s": settings.max_connection_age_s,
        # A call may wait to be taken as long as the longest deadline the mesh's clients give a call.
        "max_queued_s": settings.stream_rpc_timeout_s,
    }


@dataclass
class ServiceServer:
    """A grpc.aio server with health and reflection; `stop` drains in-flight RPCs within a grace.
    Every RPC is counted in `registry` (served at GET /metrics on `metrics_address` when one is set,
    with the components' own series registered on the same registry)."""

    registrations: Sequence[Registration]
    signer: Signer
    address: str = "127.0.0.1:0"
    grace_s: float = 10.0
    on_stop: list[Callable[[], Any]] = field(default_factory=list)
    # Work of its own to finish within the grace while in-flight RPCs do (the orchestrator's turns,
    # whose RPCs wait for them): runs beside the server's stop, not after it.
    on_drain: list[Callable[[float], Any]] = field(default_factory=list)
    port: int = 0
    stop_grace_s: float = 0.0  # the grace of the stop under way, for on_stop hooks
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    metrics_address: str = ""  # host:port of GET /metrics; empty: none
    metrics_refresh: list[Refresh] = field(default_factory=list)  # run before each scrape
    max_connection_age_s: float = 0.0  # GOAWAY to connections this old (0: never)
    # How long a call that arrived may wait for the server to take it before gRPC core cancels it.
    max_queued_s: float = 3600.0

    def __post_init__(self) -> None:
        options = server_options(self.max_queued_s)
        if self.max_connection_age_s > 0:
            # Clients reconnect (and re-resolve) on GOAWAY; calls in flight finish on the old connection
            # (no max_connection_age_grace: a turn's stream may last minutes).
            options.append(("grpc.max_connection_age_ms", int(self.max_connection_age_s * 1000)))
        self.rpc_metrics = RpcMetrics(process_series(self.registry))
        self.metrics_server: MetricsServer | None = None
        self.server = grpc.aio.server(
            options=options,
            interceptors=[
                MetricsInterceptor(self.rpc_metrics),
                *telemetry.server_interceptors(),  # a span per call, its parent from the caller's traceparent
                IdentityInterceptor(self.signer),
            ],
        )
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
        try:
            self.port = self.server.add_insecure_port(self.address)
        except RuntimeError:
            self.port = 0
        if not self.port:  # gRPC does not say why
            raise BindError(
                f"cannot listen on {self.address}: the port is in use or the host is not this one"
            )
        await self.server.start()
        for reg in self.registrations:
            await self.health.set(reg.name, health_pb2.HealthCheckResponse.SERVING)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        if self.metrics_address:
            self.metrics_server = MetricsServer(self.metrics_address, self.registry, self.metrics_refresh)
            await self.metrics_server.start()
        log.info("serving", extra={"address": self.target})
        return self

    @property
    def metrics_port(self) -> int:
        """The bound port of GET /metrics (0: none)."""
        return self.metrics_server.port if self.metrics_server is not None else 0

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING first, then stop taking RPCs and let in-flight ones and the on_drain work finish
        within the grace, together; then the on_stop hooks (close clients), each bounded by the grace.
        The whole stop takes at most the grace plus DRAIN_SETTLE_S (what a drain cuts short is
        settled in that time) and the hooks' own time."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        grace = self.stop_grace_s = grace_s if grace_s is not None else self.grace_s
        await self.health.enter_graceful_shutdown()
        drains = [asyncio.ensure_future(hook(grace)) for hook in self.on_drain]
        await self.server.stop(grace)
        if drains:
            await asyncio.wait(drains, timeout=grace + DRAIN_SETTLE_S)
        for hook in self.on_stop:
            result = hook()
            if asyncio.iscoroutine(result):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(result, grace + 10)
        if self.metrics_server is not None:
            await self.metrics_server.stop()
        log.info("stopped", extra={"address": self.target})

    async def serve_until_signal(self) -> None:
        """Runs until SIGTERM or SIGINT, then shuts down gracefully."""
        aio.settle_heap()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("signal received, draining", extra={"grace_s": self.grace_s})
        await self.stop()


class _Outgoing:
    """Every outgoing call gets a deadline (when it has none) and the acting principal's identity."""

    def __init__(self, timeout_s: float, signer: Signer) -> None:
        self.timeout_s = timeout_s
        self.signer = signer

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        principal = identity.current() or identity.MESH
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        metadata[identity.HEADER] = self.signer.mint(principal.user)
        return grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=self.timeout_s if details.timeout is None else details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )


# grpc.aio files an interceptor under the first kind it is an instance of, so one class per kind.
class _UnaryUnaryOut(_Outgoing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request)


class _UnaryStreamOut(_Outgoing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request)


class _StreamUnaryOut(_Outgoing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request_iterator)


class _StreamStreamOut(_Outgoing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):  # type: ignore[no-untyped-def]
        return await continuation(self._with(client_call_details), request_iterator)


def channel(
    target: str, signer: Signer, unary_timeout_s: float = 10.0, stream_timeout_s: float = 3600.0
) -> grpc.aio.Channel:
    """An insecure loopback/cluster channel whose RPCs always carry a deadline and the caller's identity.
    A `dns:///name:port` target with several addresses is balanced round robin. With tracing on, the
    OpenTelemetry interceptors run first (outermost): the client span covers ours, and the metadata they
    add (`traceparent`) is kept by ours, which add the identity beside it."""
    return grpc.aio.insecure_channel(
        target,
        options=[*_CHANNEL_OPTIONS, ("grpc.lb_policy_name", "round_robin")],
        interceptors=[
            *telemetry.client_interceptors(),
            _UnaryUnaryOut(unary_timeout_s, signer),
            _UnaryStreamOut(stream_timeout_s, signer),
            _StreamUnaryOut(unary_timeout_s, signer),
            _StreamStreamOut(stream_timeout_s, signer),
        ],
    )


class IdentityInterceptor(grpc.aio.ServerInterceptor):
    """Verifies the caller's identity token on every RPC (health and reflection excepted) and makes the
    principal the handler's; a missing, forged or expired token ends the call UNAUTHENTICATED.

    grpc.aio runs a call's interceptors and its handler in one task of their own (its `_handle_rpc`),
    so the principal set here is that call's alone (tests/integration/libs/test_rpc.py): the handler itself is
    returned as it is, with no wrapper per call."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")

    def __init__(self, signer: Signer) -> None:
        self.signer = signer

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN):
            return handler
        token = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == identity.HEADER:
                token = value
                break
        try:
            principal = self.signer.verify(token)
        except Unauthenticated as err:
            return _rewrap(handler, _refuse(err))
        identity.set_principal(principal)
        return handler


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts every RPC (health and reflection excepted): started, handled by status code, handling time
    (a stream's whole life) and in flight, by service, method and type. A method's counting handler
    and its series are made at its first call and kept."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self.metrics = metrics
        self._counting: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):  # type: ignore[no-untyped-def]
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(IdentityInterceptor.OPEN):
            return handler
        known = self._counting.get(method)
        if known is None or known[0] is not handler:
            service, _, name = method.lstrip("/").rpartition("/")
            kind = {
                (False, False): "unary",
                (False, True): "server_stream",
                (True, False): "client_stream",
                (True, True): "bidi_stream",
            }[(bool(handler.request_streaming), bool(handler.response_streaming))]
            counting = _rewrap(handler, _counted(self.metrics, (service, name, kind)))
            known = self._counting[method] = (handler, counting)
        return known[1]


def _code_of(context: grpc.aio.ServicerContext, failed: BaseException | None) -> str:
    """The status the RPC ended with: what the handler set or aborted with, else OK or UNKNOWN."""
    if isinstance(failed, asyncio.CancelledError | GeneratorExit):
        return "CANCELLED"  # the caller went away
    with contextlib.suppress(Exception):
        code = context.code()
        if isinstance(code, grpc.StatusCode):
            return code.name
        if isinstance(code, int) and code:
            return grpc.StatusCode(code).name  # type: ignore[call-arg]
    return "UNKNOWN" if failed is not None else "OK"


def _counted(metrics: RpcMetrics, labels: tuple[str, str, str]) -> Callable[[Any, bool], Any]:
    started_total = metrics.started.labels(*labels)
    in_flight = metrics.in_flight.labels(*labels)
    seconds = metrics.seconds.labels(*labels)
    handled: dict[str, Any] = {}  # by status code

    def begin() -> float:
        started_total.inc()
        in_flight.inc()
        return time.perf_counter()

    def end(started: float, context: grpc.aio.ServicerContext, failed: BaseException | None) -> None:
        in_flight.dec()
        seconds.observe(time.perf_counter() - started)
        code = _code_of(context, failed)
        counter = handled.get(code)
        if counter is None:
            counter = handled[code] = metrics.handled.labels(*labels, code)
        counter.inc()

    def wrap(behavior: Any, streaming_response: bool) -> Any:
        if streaming_response and inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                started, failed = begin(), None
                try:
                    async for item in behavior(request, context):
                        yield item
                except BaseException as exc:
                    failed = exc
                    raise
                finally:
                    end(started, context, failed)

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, failed = begin(), None
            try:
                return await behavior(request, context)
            except BaseException as exc:
                failed = exc
                raise
            finally:
                end(started, context, failed)

        return unary

    return wrap


def _refuse(err: Unauthenticated) -> Callable[[Any, bool], Any]:
    def wrap(behavior: Any, streaming_response: bool) -> Any:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
            await context.abort_with_status(to_status(err))

        return refuse

    return wrap


def _as(principal: identity.Principal) -> Callable[[Any, bool], Any]:
    def wrap(behavior: Any, streaming_response: bool) -> Any:
        if streaming_response and inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                identity.set_principal(principal)
                async for item in behavior(request, context):
                    yield item

            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            identity.set_principal(principal)
            return await behavior(request, context)

        return unary

    return wrap


def _rewrap(handler: grpc.RpcMethodHandler, wrap: Callable[[Any, bool], Any]) -> grpc.RpcMethodHandler:
    """The same handler with its behavior wrapped (each RPC runs in its own task, so the principal set
    by the wrapper is that call's alone)."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for attr, make, streaming in kinds:
        behavior = getattr(handler, attr)
        if behavior is not None:
            return make(
                wrap(behavior, streaming),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


async def end_call(call: Any, timeout_s: float = 5.0) -> None:
    """Ends a streaming call its caller no longer reads: cancels it (when it still runs) and reads it to
    its end, so that whatever wraps its responses finishes too (the tracing interceptor's client span
    ends there, not at the cancel). The caller's own cancellation still propagates."""
    call.cancel()
    try:
        async with asyncio.timeout(timeout_s):
            async for _ in call:
                pass
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller was cancelled, not just the call
    except (grpc.aio.AioRpcError, TimeoutError):
        pass


_ENDING: set[asyncio.Task[None]] = set()


def end_call_soon(call: Any) -> None:
    """`end_call` in the background, for a caller that must go on at once."""
    task = asyncio.get_running_loop().create_task(end_call(call))
    _ENDING.add(task)
    task.add_done_callback(_ENDING.discard)


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


def with_principal(handler: grpc.RpcMethodHandler, principal: identity.Principal) -> grpc.RpcMethodHandler:
    """`handler` run as `principal` (for a server interceptor that verified another credential)."""
    return _rewrap(handler, _as(principal))


def refused(handler: grpc.RpcMethodHandler, err: Unauthenticated) -> grpc.RpcMethodHandler:
    """`handler` replaced by one that ends the call with `err`'s status."""
    return _rewrap(handler, _refuse(err))
