"""libs.rpc on real servers: every outgoing RPC gets a deadline and the caller's signed identity; every
service refuses a call without a valid identity (UNAUTHENTICATED), whatever the request says."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2_grpc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.runtime.v1 import runtime_service_pb2_grpc
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.stream.v1 import stream_service_pb2_grpc
from libs import events as evlib
from libs import identity
from libs.identity import HEADER, Signer
from libs.rpc import channel
from tests.mesh import TEST_CATALOG, Mesh, start_mesh


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    m = await start_mesh(tmp_path_factory.mktemp("rpc"), catalog=TEST_CATALOG, rules={"rules": []})
    yield m
    await m.stop()


async def test_every_outgoing_rpc_gets_a_deadline(mesh: Mesh) -> None:
    """A subscription on an idle open buffer, made without a timeout, ends at the channel's default."""
    assert mesh.clients is not None
    key = "session:deadline-probe"
    with identity.acting_as(mesh.user):
        await mesh.clients.stream.CreateStream(ss.CreateStreamRequest(key=key))
        async with channel(mesh.settings.addresses.stream, mesh.signer, 0.3, 0.3) as ch:
            stub = stream_service_pb2_grpc.StreamServiceStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async with asyncio.timeout(5):
                    async for _ in stub.SubscribeStream(ss.SubscribeStreamRequest(key=key)):
                        pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def _calls(mesh: Mesh, ch: grpc.aio.Channel) -> dict[str, object]:
    """One call of each service a test can make without side effects."""
    orch = orchestrator_service_pb2_grpc.OrchestratorServiceStub(ch)
    runtime = runtime_service_pb2_grpc.AgentRuntimeServiceStub(ch)
    return {
        "orchestrator": lambda **kw: orch.CancelChat(orc.CancelChatRequest(session_id="nope"), **kw),
        "agent-runtime": lambda **kw: runtime.RunAgent(
            rt.RunAgentRequest(agent="general", stream_key="session:nope"), **kw
        ).read(),
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
        assert code == grpc.StatusCode.NOT_FOUND


async def test_a_stream_outlives_its_connections_age(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Servers send GOAWAY to connections older than max_connection_age_s (so round robin clients
    re-resolve and reach new replicas): a subscription open across several ages keeps every event,
    and the unary calls made meanwhile, on fresh connections, all succeed."""
    mesh = await start_mesh(
        tmp_path_factory.mktemp("age"), catalog=TEST_CATALOG, rules={"rules": []}, max_connection_age_s=0.3
    )
    try:
        assert mesh.clients is not None
        key = "session:aged-connection"
        with identity.acting_as(mesh.user):
            stream = mesh.clients.stream
            await stream.CreateStream(ss.CreateStreamRequest(key=key))
            call = stream.SubscribeStream(ss.SubscribeStreamRequest(key=key))
            loop = asyncio.get_running_loop()
            started, appended = loop.time(), 0
            while loop.time() - started < 2.0:  # more than six connection ages
                await stream.AppendEvents(
                    ss.AppendEventsRequest(key=key, events=[evlib.text_delta(f"{appended} ")])
                )
                appended += 1
                await asyncio.sleep(0.1)  # the pace of a slow model
            await stream.CloseStream(ss.CloseStreamRequest(key=key, done=ev.StreamDone()))
            received = [r.event async for r in call]
    finally:
        await mesh.stop()
    text = "".join(e.text_delta.text_delta for e in received)
    assert text == "".join(f"{i} " for i in range(appended)) and received[-1].HasField("done")
