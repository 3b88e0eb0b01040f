"""Agent-invoke (A2A) tasks: the callee's hidden trace, continuing it, state moves, listing."""

from __future__ import annotations

import grpc
from google.protobuf import struct_pb2

from agentmesh.libs import identity
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import code_of, count_rows, error_of, new_trace, recent

BAD = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION


async def test_a2a_tasks(trace_stub, trace_engine, unique, task_stub):
    owner = f"u-{unique}"
    caller = await new_trace(trace_stub, owner)
    context = struct_pb2.Struct()
    context.update({"toolCallId": "call-1", "depth": 1})
    with identity.acting_as(owner):
        task = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(
                        callee_agent="coder",
                        caller_agent="general",
                        caller_trace_id=caller.id,
                        caller_context=context,
                    )
                )
            )
        ).task
        assert (task.state, task.callee_agent, task.caller_agent, task.caller_trace_id, task.owner) == (
            tp.TASK_STATE_SUBMITTED,
            "coder",
            "general",
            caller.id,
            owner,
        )
        assert task.caller_context == context and not task.visible_in_sidebar
        assert recent(task.create_time) and task.update_time == task.create_time
        callee = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=task.trace_id))).trace
        assert (callee.kind, callee.agent, callee.visible_in_sidebar, callee.owner, callee.title) == (
            tp.TRACE_KIND_A2A,
            "coder",
            False,
            owner,
            "general -> coder",
        )

        again = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_trace_id=caller.id),
                    continue_trace_id=task.trace_id,
                )
            )
        ).task
        assert again.trace_id == task.trace_id and again.id != task.id
        assert (again.caller_agent, again.state) == ("", tp.TASK_STATE_SUBMITTED)
        traces = await count_rows(
            trace_engine, "SELECT count(*) FROM traces WHERE id = :id", id=task.trace_id
        )
        assert traces == 1
        wrong_agent = tks.CreateA2ATaskRequest(
            task=tp.A2ATask(callee_agent="researcher"), continue_trace_id=task.trace_id
        )
        error = await error_of(task_stub.CreateA2ATask(wrong_agent))
        assert (error.code(), error.details()) == (BAD, f"trace {task.trace_id} belongs to agent 'coder'")
        not_a2a = tks.CreateA2ATaskRequest(
            task=tp.A2ATask(callee_agent="general"), continue_trace_id=caller.id
        )
        assert await code_of(task_stub.CreateA2ATask(not_a2a)) == FAILED
        unknown = tks.CreateA2ATaskRequest(task=tp.A2ATask(callee_agent="nobody", caller_trace_id=caller.id))
        error = await error_of(task_stub.CreateA2ATask(unknown))
        assert (error.code(), error.details()) == (BAD, "unknown agent 'nobody'")
        no_callee = tks.CreateA2ATaskRequest(task=tp.A2ATask(caller_trace_id=caller.id))
        assert await code_of(task_stub.CreateA2ATask(no_callee)) == BAD

        working = await task_stub.UpdateA2ATask(
            tks.UpdateA2ATaskRequest(task_id=task.id, state=tp.TASK_STATE_WORKING)
        )
        assert working.task.state == tp.TASK_STATE_WORKING
        assert working.task.update_time.ToNanoseconds() > task.update_time.ToNanoseconds()
        same = await task_stub.UpdateA2ATask(
            tks.UpdateA2ATaskRequest(task_id=task.id, state=tp.TASK_STATE_WORKING)
        )
        assert same.task == working.task  # no move, no change
        unset = tks.UpdateA2ATaskRequest(task_id=task.id)
        assert await code_of(task_stub.UpdateA2ATask(unset)) == BAD
        await task_stub.UpdateA2ATask(
            tks.UpdateA2ATaskRequest(task_id=task.id, state=tp.TASK_STATE_COMPLETED)
        )
        for state in (tp.TASK_STATE_WORKING, tp.TASK_STATE_FAILED, tp.TASK_STATE_CANCELED):
            reopen = tks.UpdateA2ATaskRequest(task_id=task.id, state=state)
            error = await error_of(task_stub.UpdateA2ATask(reopen))
            assert (error.code(), error.details()) == (FAILED, "task is already completed")
        got = await task_stub.GetA2ATask(tks.GetA2ATaskRequest(task_id=task.id))
        assert got.task.state == tp.TASK_STATE_COMPLETED
        assert await code_of(task_stub.GetA2ATask(tks.GetA2ATaskRequest())) == BAD
        listed = await task_stub.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=caller.id))
        assert [t.id for t in listed.tasks] == [task.id, again.id]


async def test_visible_task_shows_its_callee_trace(trace_stub, unique, task_stub):
    """A task created (or continued) visible_in_sidebar makes its callee trace visible."""
    owner = f"u-{unique}"
    caller = await new_trace(trace_stub, owner)
    with identity.acting_as(owner):
        hidden = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(task=tp.A2ATask(callee_agent="coder", caller_trace_id=caller.id))
            )
        ).task
        shown = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", visible_in_sidebar=True),
                    continue_trace_id=hidden.trace_id,
                )
            )
        ).task
        assert (shown.trace_id, shown.visible_in_sidebar, shown.caller_trace_id) == (
            hidden.trace_id,
            True,
            "",
        )
        callee = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=hidden.trace_id))).trace
        assert callee.visible_in_sidebar
        # A task without a caller session is not listed under any session.
        listed = await task_stub.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=caller.id))
        assert [t.id for t in listed.tasks] == [hidden.id]
