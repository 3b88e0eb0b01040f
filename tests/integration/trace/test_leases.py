"""LeaseService: work in progress whose runner stopped renewing its lease is settled by a reaper, never
twice, and its buffers are named so they can be ended. On SQLite and PostgreSQL. Time is not waited
for: a service with a lease of 0 s sees every unrenewed row expired at once, one with 60 s none."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.leases.v1 import lease_service_pb2 as ls
from agentmesh.leases.v1 import lease_service_pb2_grpc
from agentmesh.libs import identity
from agentmesh.libs.identity import Signer
from agentmesh.libs.rpc import channel
from agentmesh.services.trace.server import build
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
from tests.conftest import service_settings
from tests.integration.trace.conftest import TraceStubs, append, error_of, new_trace

Stubs = tuple[TraceStubs, lease_service_pb2_grpc.LeaseServiceStub]


@pytest.fixture
async def trace_with_lease(
    empty_database: str, tmp_path: Path, signer: Signer
) -> AsyncIterator[Callable[[float], Awaitable[Stubs]]]:
    """`await trace_with_lease(lease_s)`: a trace service on the test's own database with that lease."""
    running: list[Any] = []

    async def make(lease_s: float) -> Stubs:
        settings = service_settings(database_url=empty_database, data_dir=tmp_path, lease_s=lease_s)
        server = await build(settings, "127.0.0.1:0")
        ch = channel(server.target, signer)
        running.append((server, ch))
        stubs = TraceStubs(
            trace_service_pb2_grpc.TraceServiceStub(ch),
            message_service_pb2_grpc.MessageServiceStub(ch),
            task_service_pb2_grpc.TaskServiceStub(ch),
            subagent_service_pb2_grpc.SubagentServiceStub(ch),
        )
        return stubs, lease_service_pb2_grpc.LeaseServiceStub(ch)

    yield make
    for server, ch in running:
        await ch.close()
        await server.stop(0)


async def reap(leases: lease_service_pb2_grpc.LeaseServiceStub) -> ls.ReapExpiredResponse:
    with identity.acting_as(""):
        return await leases.ReapExpired(ls.ReapExpiredRequest())


async def pending(stub: TraceStubs, owner: str, trace_id: str) -> tp.Message:
    return await append(
        stub.messages, owner, trace_id, "", role=tp.MESSAGE_ROLE_ASSISTANT, status=tp.MESSAGE_STATUS_PENDING
    )


async def message(stub: TraceStubs, owner: str, message_id: int) -> tp.Message:
    with identity.acting_as(owner):
        return (await stub.messages.GetMessage(ms.GetMessageRequest(message_id=message_id))).message


async def test_a_live_lease_is_never_reaped(trace_with_lease, unique):
    stub, leases = await trace_with_lease(60.0)
    owner = f"u-{unique}"
    fresh = await pending(stub, owner, (await new_trace(stub.traces, owner)).id)
    renewed = await pending(stub, owner, (await new_trace(stub.traces, owner)).id)
    with identity.acting_as(""):
        resp = await leases.RenewLeases(ls.RenewLeasesRequest(message_ids=[renewed.id, 987654321]))
    assert resp.renewed == 1, "only rows still in progress are renewed"
    assert await reap(leases) == ls.ReapExpiredResponse()
    for m in (fresh, renewed):
        assert (await message(stub, owner, m.id)).status == tp.MESSAGE_STATUS_PENDING


async def test_an_expired_placeholder_is_settled_once_and_its_buffer_named(trace_with_lease, unique):
    stub, leases = await trace_with_lease(0.0)
    owner = f"u-{unique}"
    chat = await new_trace(stub.traces, owner)
    await append(stub.messages, owner, chat.id, "hi")
    orphan = await pending(stub, owner, chat.id)
    done = await append(stub.messages, owner, chat.id, "finished", role=tp.MESSAGE_ROLE_ASSISTANT)
    reaped = await reap(leases)
    assert (reaped.messages, reaped.tasks, reaped.subagents) == (1, 0, 0)
    assert list(reaped.stream_keys) == [f"trace:{chat.id}"]
    settled = await message(stub, owner, orphan.id)
    assert settled.status == tp.MESSAGE_STATUS_FAILED and settled.metadata["error"]["code"] == "interrupted"
    assert (await message(stub, owner, done.id)).status == tp.MESSAGE_STATUS_COMPLETED, "finished work stays"
    assert await reap(leases) == ls.ReapExpiredResponse(), "settled once"
    # Its run is listed interrupted, with the time it was settled as its end.
    with identity.acting_as(owner):
        listed = (await stub.traces.ListRuns(ts.ListRunsRequest(state=tp.RUN_STATE_INTERRUPTED))).runs
    assert [r.message_id for r in listed] == [orphan.id]
    assert listed[0].HasField("end_time") and "stopped" in listed[0].error


async def test_tasks_subagents_and_child_traces_are_settled_with_their_buffers(trace_with_lease, unique):
    stub, leases = await trace_with_lease(0.0)
    owner = f"u-{unique}"
    caller = await new_trace(stub.traces, owner)
    await append(stub.messages, owner, caller.id, "go")
    anchor = await append(
        stub.messages, owner, caller.id, "", role=tp.MESSAGE_ROLE_ASSISTANT
    )  # the anchor: settled
    with identity.acting_as(owner):
        task = (
            await stub.tasks.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_agent="general", caller_trace_id=caller.id)
                )
            )
        ).task
        subs = (
            await stub.subagents.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(
                    subagents=[
                        tp.SubagentSession(
                            trace_id=caller.id,
                            parent_message_id=anchor.id,
                            source_type=ev.SUBAGENT_SOURCE_PRESET,
                            preset_agent="coder",
                            name="c",
                            goal="g",
                        )
                    ]
                )
            )
        ).subagents
    callee = await append(
        stub.messages, owner, task.trace_id, "", role=tp.MESSAGE_ROLE_ASSISTANT,
        status=tp.MESSAGE_STATUS_PENDING, source=tp.MESSAGE_SOURCE_A2A, a2a_task_id=task.id,
    )  # fmt: skip
    child = await pending(stub, owner, subs[0].child_trace_id)
    reaped = await reap(leases)
    assert (reaped.messages, reaped.tasks, reaped.subagents) == (2, 1, 1)
    assert sorted(reaped.stream_keys) == sorted([f"a2a:{task.id}", f"subagent:{subs[0].id}"])
    with identity.acting_as(owner):
        assert (
            await stub.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task.id))
        ).task.state == tp.TASK_STATE_FAILED
        sub = (
            await stub.subagents.GetSubagentSession(sbs.GetSubagentSessionRequest(subagent_id=subs[0].id))
        ).subagent
    assert sub.status == ev.SUBAGENT_STATUS_FAILED and sub.error.startswith("interrupted")
    assert sub.HasField("end_time")
    for m in (callee, child):
        assert (await message(stub, owner, m.id)).status == tp.MESSAGE_STATUS_FAILED


async def test_concurrent_reapers_never_settle_a_row_twice(trace_with_lease, unique):
    stub, leases = await trace_with_lease(0.0)
    owner = f"u-{unique}"
    traces = [await new_trace(stub.traces, owner) for _ in range(20)]
    for t in traces:
        await pending(stub, owner, t.id)
    rounds = await asyncio.gather(*(reap(leases) for _ in range(4)))
    assert sum(r.messages for r in rounds) == 20
    keys = [k for r in rounds for k in r.stream_keys]
    assert sorted(keys) == sorted(f"trace:{t.id}" for t in traces), "each buffer named once"


async def test_only_the_mesh_keeps_leases(trace_with_lease, unique):
    _, leases = await trace_with_lease(60.0)
    with identity.acting_as(f"u-{unique}"):
        for call in (
            leases.ReapExpired(ls.ReapExpiredRequest()),
            leases.RenewLeases(ls.RenewLeasesRequest()),
        ):
            err = await error_of(call)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    with identity.acting_as(""):
        err = await error_of(leases.ReapExpired(ls.ReapExpiredRequest(limit=-1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
