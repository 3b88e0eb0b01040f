"""libs.rpc on real servers: every outgoing RPC gets a deadline and the caller's signed identity; every
service refuses a call without a valid identity (UNAUTHENTICATED), whatever the request says."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events as evlib
from agentmesh.libs import identity
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.identity import HEADER, Signer
from agentmesh.libs.rpc import Registration, ServiceServer, channel, server_settings
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2_grpc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.runtime.v1 import runtime_service_pb2_grpc
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.stream.v1 import stream_service_pb2_grpc
from tests.mesh import TEST_CATALOG, Mesh, start_mesh

pytestmark = pytest.mark.mesh(catalog=TEST_CATALOG, rules={"rules": []})


async def test_every_outgoing_rpc_gets_a_deadline(mesh: Mesh) -> None:
    """A follow of an idle open buffer, its call made without a timeout, ends at the channel's default."""
    assert mesh.clients is not None
    key = "trace:deadline-probe"
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        async with channel(mesh.settings.addresses.stream, mesh.signer, 0.3, 0.3) as ch:
            stub = stream_service_pb2_grpc.StreamServiceStub(ch)
            follow = ss.StreamFollow(id=1, subscription=ss.SubscribeStreamRequest(key=key))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(5):
                    async for _ in stub.FollowStreams(iter([ss.FollowStreamsRequest(follows=[follow])])):
                        pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _calls(mesh: Mesh, ch: grpc.aio.Channel) -> dict[str, object]:
    """One call of each service a test can make without side effects."""
    orch = orchestrator_service_pb2_grpc.OrchestratorServiceStub(ch)
    runtime = runtime_service_pb2_grpc.AgentRuntimeServiceStub(ch)
    return {
        "orchestrator": lambda **kw: orch.CancelTurn(orc.CancelTurnRequest(trace_id="nope"), **kw),
        "agent-runtime": lambda **kw: runtime.RunAgent(
            rt.RunAgentRequest(agent=ap.Agent(slug="general"), input="hello"),  # no buffer to write
            **kw,
        ),
    }


async def _code(aw: object) -> grpc.StatusCode:
    try:
        await aw  # type: ignore[misc]
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", ["orchestrator", "agent-runtime"])
async def test_a_call_without_a_valid_identity_is_unauthenticated(mesh: Mesh, service: str) -> None:
    target = mesh.servers[service].target
    forged = Signer(b"not-the-mesh-secret-at-all-0123456789").mint("alice")
    good = mesh.signer.mint("alice")
    tampered = good[:-3] + ("AAA" if not good.endswith("AAA") else "BBB")
    expired = Signer(mesh.settings.mesh_secret.encode(), clock=lambda: 1_000_000.0).mint("alice")
    async with grpc.aio.insecure_channel(target) as bare:
        call = _calls(mesh, bare)[service]
        assert await _code(call(timeout=5)) == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[operator]
        for token in (forged, tampered, expired, "v1.garbage", ""):
            code = await _code(call(timeout=5, metadata=((HEADER, token),)))  # type: ignore[operator]
            assert code == grpc.StatusCode.UNAUTHENTICATED, token
        # The mesh's own principal (no user) cannot act for a user either.
        mesh_token = mesh.signer.mint("")
        code = await _code(call(timeout=5, metadata=((HEADER, mesh_token),)))  # type: ignore[operator]
        assert code == grpc.StatusCode.UNAUTHENTICATED
        # A valid identity gets past the interceptor: the request itself is what fails.
        code = await _code(call(timeout=5, metadata=((HEADER, good),)))  # type: ignore[operator]
        assert code == {"orchestrator": grpc.StatusCode.NOT_FOUND}.get(
            service, grpc.StatusCode.INVALID_ARGUMENT
        )


async def test_a_stream_outlives_its_connections_age(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers send GOAWAY to connections older than max_connection_age_s (so round robin clients
    re-resolve and reach new replicas): a follow open across several ages keeps every event, and the
    unary calls made meanwhile, on fresh connections, all succeed."""
    mesh = await start_mesh(
        tmp_path_factory.mktemp("age"), catalog=TEST_CATALOG, rules={"rules": []}, max_connection_age_s=0.3
    )
    try:
        assert mesh.clients is not None
        key = "trace:aged-connection"
        with identity.acting_as(mesh.user):
            stream = mesh.clients.stream
            await stream.CreateStream(ss.CreateStreamRequest(key=key))
            follow = mesh.clients.follows.follow(key)
            loop = asyncio.get_running_loop()
            started, appended = loop.time(), 0
            while loop.time() - started < 2.0:  # more than six connection ages
                await stream.AppendEvents(
                    ss.AppendEventsRequest(key=key, events=[evlib.text_delta(f"{appended} ")])
                )
                appended += 1
                await asyncio.sleep(0.1)  # the pace of a slow model
            await stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone()))
            received = [e async for e in follow]
    finally:
        await mesh.stop()
    text = "".join(e.text_delta.text_delta for e in received)
    assert text == "".join(f"{i} " for i in range(appended)) and received[-1].HasField("done")


def _checks_queued(
    target: str, blocked: threading.Event, release: threading.Event, queued_s: float
) -> list[str]:
    """Runs in a thread while the server's loop is blocked: four Health.Check calls arrive and stay in
    gRPC core's queue of calls not yet taken for `queued_s`, a fifth arrives, then the loop is released.
    Returns every call's status."""
    try:
        assert blocked.wait(10), "the server's loop was not blocked"
        with grpc.insecure_channel(target) as ch:
            check = ch.unary_unary(
                "/grpc.health.v1.Health/Check",
                request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                response_deserializer=health_pb2.HealthCheckResponse.FromString,
            )
            calls = [check.future(health_pb2.HealthCheckRequest(), timeout=30) for _ in range(4)]
            time.sleep(queued_s)  # the load under test (how long calls stay queued), not a synchronisation
            calls.append(check.future(health_pb2.HealthCheckRequest(), timeout=30))
            release.set()
            return [c.exception().code().name if c.exception() else "OK" for c in calls]  # type: ignore[union-attr]
    finally:
        release.set()


@pytest.mark.parametrize("stream_rpc_timeout_s", [1.0, 30.0])
async def test_a_call_queued_behind_a_busy_loop_waits_as_long_as_a_deadline_allows(
    tmp_path: Path, stream_rpc_timeout_s: float
) -> None:
    """grpc.aio takes calls one at a time, one event-loop round trip each: calls that arrive while the
    server's loop is saturated wait in gRPC core, which cancels (bare CANCELLED) those not taken within
    grpc.server_max_unrequested_time_in_server, 30 s unless set; 1,000 chat turns on 2 cores lost their
    RunAgent calls that way. A mesh server lets a call wait as long as the longest deadline the mesh's
    clients give (stream_rpc_timeout_s, an hour). Here the loop is blocked for 2 s while calls arrive:
    with a 1 s limit the calls that waited end CANCELLED (the mechanism), with 30 s all are served."""
    settings = MeshSettings(data_dir=tmp_path, stream_rpc_timeout_s=stream_rpc_timeout_s)
    args = {**server_settings(settings, "agent_runtime"), "address": "127.0.0.1:0"}
    server = await ServiceServer([], Signer(b"0123456789abcdef0123456789abcdef"), **args).start()
    blocked, release = threading.Event(), threading.Event()
    try:
        codes = asyncio.get_running_loop().run_in_executor(
            None, _checks_queued, server.target, blocked, release, 2.0
        )
        blocked.set()
        assert release.wait(20)  # blocks this loop, the server's, as a saturated loop would
        result = await asyncio.wait_for(codes, 20)
    finally:
        release.set()
        await server.stop(0)
    if stream_rpc_timeout_s < 2.0:
        assert "CANCELLED" in result, result
    else:
        assert result == ["OK"] * 5


async def test_a_server_slow_to_answer_a_new_connection_is_waited_for(mesh: Mesh) -> None:
    """A busy server answers a new connection's handshake late: the mesh's channels give a connection
    attempt the time gRPC's default gives it (their short reconnect backoff is not a connect timeout),
    so the call goes through instead of failing UNAVAILABLE ("connection attempt timed out before
    receiving SETTINGS frame", what a 100 ms grpc.min_reconnect_backoff_ms did)."""
    target = mesh.settings.addresses.stream
    host, _, port = target.rpartition(":")

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay_s: float) -> None:
            first = True
            while data := await src.read(65536):
                if first:
                    await asyncio.sleep(delay_s)  # the server's handshake, late
                    first = False
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, 0.0), pipe(up_reader, writer, 0.6), return_exceptions=True
        )

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    relayed = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with channel(relayed, mesh.signer) as ch:
            stub = stream_service_pb2_grpc.StreamServiceStub(ch)
            with identity.acting_as(mesh.user):
                info = await stub.GetStreamInfo(ss.GetStreamInfoRequest(key="trace:slow-hello"), timeout=10)
        assert not info.exists
    finally:
        server.close()
        await server.wait_closed()


def _probe(entered: asyncio.Event, release: asyncio.Event, expected: int) -> Registration:
    """A probe service (not one of the mesh's): each call reports the principal its handler runs as,
    after every call of the test is in flight at once."""
    arrived = 0

    async def hold() -> None:
        nonlocal arrived
        arrived += 1
        if arrived == expected:
            entered.set()
        await release.wait()

    async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await hold()
        return identity.current_user().encode()

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"in flight"
        await hold()
        yield identity.current_user().encode()

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
    }

    def add(servicer: object, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Probe", handlers),))

    return Registration(add, None, "test.Probe")


async def test_each_call_runs_as_its_own_caller_while_many_are_in_flight(tmp_path: Path) -> None:
    """The identity interceptor makes the verified principal the handler's without a wrapper per call
    (grpc.aio runs a call's interceptors and handler in one task): 40 calls of 20 users, unary and
    streaming, all in flight at once, each handler sees its own caller; and the calls are counted."""
    signer = Signer(b"0123456789abcdef0123456789abcdef")
    entered, release = asyncio.Event(), asyncio.Event()
    server = await ServiceServer([_probe(entered, release, 40)], signer).start()
    try:
        async with channel(server.target, signer) as ch:
            unary = ch.unary_unary("/test.Probe/Unary")
            stream = ch.unary_stream("/test.Probe/Stream")

            async def call(user: str, streaming: bool) -> str:
                with identity.acting_as(user):
                    if not streaming:
                        return (await unary(b"")).decode()
                    answers = [a async for a in stream(b"")]
                    return answers[-1].decode()

            users = [(f"user-{i % 20}", i % 2 == 1) for i in range(40)]
            calls = [asyncio.ensure_future(call(u, s)) for u, s in users]
            await asyncio.wait_for(entered.wait(), 20)
            release.set()
            got = await asyncio.wait_for(asyncio.gather(*calls), 20)
            assert got == [u for u, _ in users]
            with identity.acting_as("user-after"):  # and one more, once the others have ended
                assert (await unary(b"")).decode() == "user-after"
    finally:
        release.set()
        await server.stop(0)
    counted = server.registry.get_sample_value(
        "agentmesh_grpc_server_handled_total",
        {"grpc_service": "test.Probe", "grpc_method": "Unary", "grpc_type": "unary", "grpc_code": "OK"},
    )
    assert counted == 21
