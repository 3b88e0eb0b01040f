"""The trace process trusts only a verified caller identity (libs.rpc.IdentityInterceptor): every service
it serves (TraceService, MessageService, TaskService, SubagentService, AgentService, AuthService,
LeaseService) refuses a call without a valid token signed with the mesh secret; the user-only ones also
refuse the mesh's own principal. Health stays open."""

from __future__ import annotations

import string
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.agents.v1 import agent_service_pb2_grpc
from agentmesh.auth.v1 import auth_service_pb2 as au
from agentmesh.auth.v1 import auth_service_pb2_grpc
from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.leases.v1 import lease_service_pb2_grpc
from agentmesh.libs import identity
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import channel
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import (
    message_service_pb2_grpc,
    subagent_service_pb2_grpc,
    task_service_pb2_grpc,
    trace_service_pb2_grpc,
)
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.conftest import TEST_SECRET
from tests.integration.trace.conftest import append, error_of, new_trace

UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
PENDING = tp.MESSAGE_STATUS_PENDING
NEEDS_USER = "this call needs a user's identity"
MESH_ONLY = "API keys are managed by the mesh itself, not on behalf of a user"


@dataclass(frozen=True)
class Service:
    """One service of the trace process and an RPC to probe it with."""

    stub: Callable[[grpc.aio.Channel], Any]
    call: Callable[[Any, str], Any]  # (stub, unique) -> the call
    answered: Callable[[Any, str], bool]  # (response, unique) -> whether it is the expected answer
    user_only: bool  # refuses the mesh's own principal (else: refuses a user's, answers only the mesh)

    def acts_as(self, unique: str) -> str:
        """The principal the probe is made as: a user, or the mesh itself ("")."""
        return f"u-{unique}" if self.user_only else ""


SERVICES = {
    "TraceService": Service(
        trace_service_pb2_grpc.TraceServiceStub,
        lambda stub, _: stub.CreateTrace(
            ts.CreateTraceRequest(trace=tp.Trace(agent="general", title="probe"))
        ),
        lambda resp, unique: resp.trace.owner == f"u-{unique}" and resp.trace.title == "probe",
        user_only=True,
    ),
    "MessageService": Service(
        message_service_pb2_grpc.MessageServiceStub,
        lambda stub, _: stub.BeginTurn(
            ms.BeginTurnRequest(
                new_trace=tp.Trace(agent="general"),
                user_message=tp.Message(role=tp.MESSAGE_ROLE_USER, content="probe"),
                assistant_message=tp.Message(
                    role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING
                ),
            )
        ),
        lambda resp, unique: resp.trace.owner == f"u-{unique}" and resp.user_message.content == "probe",
        user_only=True,
    ),
    "TaskService": Service(
        task_service_pb2_grpc.TaskServiceStub,
        lambda stub, _: stub.CreateA2ATask(tks.CreateA2ATaskRequest(task=tp.A2ATask(callee_agent="coder"))),
        lambda resp, unique: resp.task.owner == f"u-{unique}" and resp.task.callee_agent == "coder",
        user_only=True,
    ),
    "SubagentService": Service(
        subagent_service_pb2_grpc.SubagentServiceStub,
        lambda stub, _: stub.CreateSubagentSessions(sbs.CreateSubagentSessionsRequest()),
        lambda resp, _: list(resp.subagents) == [],
        user_only=True,
    ),
    "AgentService": Service(
        agent_service_pb2_grpc.AgentServiceStub,
        lambda stub, _: stub.ListAgents(ag.ListAgentsRequest()),
        lambda resp, _: [a.slug for a in resp.agents] == ["coder", "general", "researcher"],
        user_only=True,
    ),
    # Called by the mesh itself (the runners renewing leases, a reaper).
    "LeaseService": Service(
        lease_service_pb2_grpc.LeaseServiceStub,
        lambda stub, _: stub.RenewLeases(ls.RenewLeasesRequest(message_ids=[987_654_321])),
        lambda resp, _: resp.renewed == 0,
        user_only=False,
    ),
    # Called by the mesh itself (the gateway checking a key, `agentmesh keys create`).
    "AuthService": Service(
        auth_service_pb2_grpc.AuthServiceStub,
        lambda stub, unique: stub.CreateApiKey(au.CreateApiKeyRequest(user=f"k-{unique}")),
        lambda resp, unique: resp.user == f"k-{unique}" and resp.api_key.startswith("am_"),
        user_only=False,
    ),
}


@pytest.fixture(params=sorted(SERVICES))
def service(request: pytest.FixtureRequest) -> Service:
    return SERVICES[request.param]


@pytest.fixture
async def bare_channel(trace_server) -> AsyncIterator[grpc.aio.Channel]:
    """A channel that adds no identity: the test sends what it wants as metadata."""
    async with grpc.aio.insecure_channel(trace_server.target) as ch:
        yield ch


async def _refused(call: Any) -> str:
    """The details of an UNAUTHENTICATED failure (fails the test on any other outcome)."""
    error = await error_of(call)
    assert error.code() == UNAUTHENTICATED, error
    return str(error.details())


def _with_token(service: Service, ch: grpc.aio.Channel, unique: str, token: str) -> Any:
    """The service's probe call on `ch` with `token` as the identity metadata."""

    class Stub:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            method = getattr(self.inner, name)
            return lambda request: method(request, metadata=((identity.HEADER, token),), timeout=30)

    return service.call(Stub(service.stub(ch)), unique)


async def test_no_identity_is_unauthenticated(service, bare_channel, unique):
    stub = service.stub(bare_channel)
    assert await _refused(service.call(stub, unique)) == "missing caller identity"


async def test_token_of_another_secret_is_unauthenticated(service, trace_server, unique):
    other = Signer(b"some-other-mesh-secret-0123456789")
    async with channel(trace_server.target, other) as ch:
        with identity.acting_as(service.acts_as(unique)):
            call = service.call(service.stub(ch), unique)
        assert await _refused(call) == "caller identity has a bad signature"


async def test_tampered_token_is_unauthenticated(service, signer, bare_channel, unique):
    token = signer.mint(service.acts_as(unique))
    version, claims, signature = token.split(".")
    # The token as minted passes on the same raw channel (so the refusals below are the tampering's).
    assert service.answered(await _with_token(service, bare_channel, unique, token), unique)
    # One character of the claims changed.
    i = len(claims) // 2
    swapped = next(c for c in string.ascii_letters if c != claims[i])
    tampered = f"{version}.{claims[:i]}{swapped}{claims[i + 1 :]}.{signature}"
    assert await _refused(_with_token(service, bare_channel, unique, tampered)) == (
        "caller identity has a bad signature"
    )
    # Claims for another user under the original signature.
    other_claims = signer.mint(f"mallory-{unique}").split(".")[1]
    forged = f"{version}.{other_claims}.{signature}"
    assert await _refused(_with_token(service, bare_channel, unique, forged)) == (
        "caller identity has a bad signature"
    )
    for malformed in ("garbage", f"v2.{claims}.{signature}", f"v1..{signature}", f"v1.{claims}."):
        assert await _refused(_with_token(service, bare_channel, unique, malformed)) == (
            "malformed caller identity"
        ), malformed


async def test_expired_token_is_unauthenticated(service, trace_server, unique):
    past = Signer(TEST_SECRET.encode(), clock=lambda: time.time() - 3600)  # the right secret, an hour ago
    async with channel(trace_server.target, past) as ch:
        with identity.acting_as(service.acts_as(unique)):
            call = service.call(service.stub(ch), unique)
        assert await _refused(call) == "caller identity expired"


async def test_mesh_principal(service, trace_channel, unique):
    """The mesh's own principal (a valid token with no user): refused where a user is needed."""
    stub = service.stub(trace_channel)
    with identity.acting_as(""):
        call = service.call(stub, unique)
    if service.user_only:
        assert await _refused(call) == NEEDS_USER
    else:
        assert service.answered(await call, unique)
    assert identity.current() is None  # nothing leaked into the test's own context


async def test_valid_identity_succeeds(service, trace_channel, unique):
    stub = service.stub(trace_channel)
    with identity.acting_as(service.acts_as(unique)):
        resp = await service.call(stub, unique)
    assert service.answered(resp, unique)


async def test_keys_are_not_managed_for_a_user(auth_stub, unique):
    """AuthService answers the mesh itself only: a call acting for a user is refused."""
    with identity.acting_as(f"u-{unique}"):
        error = await error_of(auth_stub.CreateApiKey(au.CreateApiKeyRequest(user=f"x-{unique}")))
        again = await error_of(auth_stub.AuthenticateApiKey(au.AuthenticateApiKeyRequest(api_key="am_x")))
    for err in (error, again):
        assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, MESH_ONLY)


async def test_health_needs_no_identity(bare_channel):
    resp = await health_pb2_grpc.HealthStub(bare_channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_another_users_trace_reads_like_a_missing_one(trace_stub, unique, message_stub):
    owner, stranger = f"a-{unique}", f"b-{unique}"
    trace = await new_trace(trace_stub, owner, title="private")
    await append(message_stub, owner, trace.id, "secret")
    await new_trace(trace_stub, stranger)
    with identity.acting_as(stranger):
        probe = await error_of(trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace.id)))
        missing = await error_of(trace_stub.GetTrace(ts.GetTraceRequest(trace_id=f"missing-{unique}")))
    assert (probe.code(), probe.details()) == (grpc.StatusCode.NOT_FOUND, "trace not found")
    assert (missing.code(), missing.details()) == (probe.code(), probe.details())
    with identity.acting_as(owner):
        mine = await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace.id))
    assert (mine.trace.title, mine.trace.owner) == ("private", owner)
