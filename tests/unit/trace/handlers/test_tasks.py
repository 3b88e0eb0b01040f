"""services/trace/handlers/tasks.py: what a task may continue, its state moves and its pages; a trace
store that holds copies of peers' traces says so through its interface (`copy_for_turn`)."""

from __future__ import annotations

import pytest

from agentmesh.libs.errors import FailedPrecondition, InvalidArgument
from agentmesh.services.trace.handlers.tasks import TaskHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.base import InboundTaskQuery, TraceCopy
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.services.trace.store.sql.traces import SqlTraceStore
from agentmesh.trace.v1 import trace_pb2 as tp

S = tp


async def test_a_task_needs_its_callee_and_begins_submitted(tasks: TaskHandler, unique: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^callee_agent is required$"):
        await tasks.create(f"u-{unique}", tp.A2ATask())
    task = await tasks.create(f"u-{unique}", tp.A2ATask(callee_agent="coder", state=S.TASK_STATE_COMPLETED))
    assert (task.state, task.callee_agent) == (S.TASK_STATE_SUBMITTED, "coder")


async def test_a_task_continues_only_an_agent_invoke_trace_of_its_callee(
    tasks: TaskHandler, traces: TraceHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    chat = await traces.create(owner, tp.Trace(agent="coder"))
    with pytest.raises(FailedPrecondition, match=r"^continue_trace_id is not the trace of an agent-invoke"):
        await tasks.create(owner, tp.A2ATask(callee_agent="coder"), chat.id)
    first = await tasks.create(owner, tp.A2ATask(callee_agent="coder"))
    with pytest.raises(InvalidArgument, match=rf"^trace {first.trace_id} belongs to agent 'coder'$"):
        await tasks.create(owner, tp.A2ATask(callee_agent="researcher"), first.trace_id)
    again = await tasks.create(owner, tp.A2ATask(callee_agent="coder"), first.trace_id)
    assert again.trace_id == first.trace_id and again.id != first.id


class CopyingTraces(SqlTraceStore):
    """A trace store that holds a copy of one peer's trace: `@peer/home-id` runs on `copy_id` here."""

    def __init__(self, inner: SqlTraceStore, copy_id: str) -> None:
        super().__init__(inner.db)
        self.copy_id = copy_id

    async def copy_for_turn(self, owner: str, trace_id: str) -> TraceCopy | None:
        return TraceCopy(self.copy_id, trace_id) if trace_id.startswith("@") else None


async def test_a_task_on_a_peers_trace_runs_on_the_copy_the_store_offers(
    stores: SqlStores, traces: TraceHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    # A copy is a chat trace here (the peer's kind is not checked), of the callee's agent.
    copy = await traces.create(owner, tp.Trace(agent="coder"))
    handler = TaskHandler(stores.tasks, CopyingTraces(stores.traces, copy.id))
    with pytest.raises(FailedPrecondition):  # a local chat trace is still no agent-invoke trace
        await handler.create(owner, tp.A2ATask(callee_agent="coder"), copy.id)
    await stores.copies.save(owner, "@peer/home-id", tp.Trace(agent="coder"), [], final=True)
    found = await stores.copies.find(owner, "@peer/home-id")
    assert found is not None
    handler = TaskHandler(stores.tasks, CopyingTraces(stores.traces, found.trace_id))
    task = await handler.create(owner, tp.A2ATask(callee_agent="coder"), "@peer/home-id")
    assert task.trace_id == "@peer/home-id"  # named by its home id; stored on the copy
    assert (await handler.get(owner, task.id)).trace_id == found.trace_id


async def test_a_final_state_stays(tasks: TaskHandler, unique: str) -> None:
    owner = f"u-{unique}"
    task = await tasks.create(owner, tp.A2ATask(callee_agent="coder"))
    with pytest.raises(InvalidArgument, match=r"^state is required$"):
        await tasks.update_state(owner, task.id, S.TASK_STATE_UNSPECIFIED)
    with pytest.raises(InvalidArgument, match=r"^task_id is required$"):
        await tasks.update_state(owner, "", S.TASK_STATE_WORKING)
    assert (await tasks.update_state(owner, task.id, S.TASK_STATE_WORKING)).state == S.TASK_STATE_WORKING
    done = await tasks.update_state(owner, task.id, S.TASK_STATE_INPUT_REQUIRED)
    done = await tasks.update_state(owner, task.id, S.TASK_STATE_COMPLETED)
    assert (await tasks.update_state(owner, task.id, S.TASK_STATE_COMPLETED)).update_time == done.update_time
    for state in (S.TASK_STATE_WORKING, S.TASK_STATE_FAILED, S.TASK_STATE_CANCELED):
        with pytest.raises(FailedPrecondition, match=r"^task is already completed$"):
            await tasks.update_state(owner, task.id, state)
    assert (await tasks.get(owner, task.id)).state == S.TASK_STATE_COMPLETED


async def test_inbound_tasks_page_newest_first(tasks: TaskHandler, traces: TraceHandler, unique: str) -> None:
    owner = f"u-{unique}"
    caller = await traces.create(owner, tp.Trace(agent="general"))
    inbound = [await tasks.create(owner, tp.A2ATask(callee_agent="coder")) for _ in range(5)]
    await tasks.create(owner, tp.A2ATask(callee_agent="coder", caller_trace_id=caller.id))  # not inbound
    seen, token = [], ""
    while True:
        page, token = await tasks.list_inbound(owner, InboundTaskQuery(), 2, token)
        seen += [t.id for t in page]
        if not token:
            break
    assert seen == [t.id for t in reversed(inbound)]
    with pytest.raises(InvalidArgument, match=r"^state is required$"):
        await tasks.list_inbound(owner, InboundTaskQuery(state=99), 2, "")
    assert [t.id for t in await tasks.list_started(owner, caller.id)] != []
