"""Agent-invoke tasks (docs/requirements.md#invoke-task-rows): what a task may continue, the states it
moves through (a final one stays), pages of inbound tasks; a TaskStore keeps them."""

from __future__ import annotations

from datetime import UTC

from agentmesh.libs.errors import FailedPrecondition, InvalidArgument
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import need, need_enum, need_owner
from agentmesh.services.trace.store.base import InboundTaskQuery, TaskStore, TraceStore
from agentmesh.trace.v1 import trace_pb2 as tp

STATE = tp.TaskState.DESCRIPTOR


class TaskHandler:
    def __init__(self, store: TaskStore, traces: TraceStore) -> None:
        self.store = store
        self.traces = traces  # the trace a task continues

    async def create(self, owner: str, task: tp.A2ATask, continue_trace_id: str = "") -> tp.A2ATask:
        """A task, submitted, with the callee's hidden trace: a new one, or `continue_trace_id` (an
        agent-invoke trace of the same callee). Continuing a peer's trace (continueFrom @alias/id) runs
        the callee on our cached copy of it (synced now), and the task names the trace by its home id."""
        need_owner(owner)
        need(task.callee_agent, "callee_agent")
        home = ""
        if continue_trace_id:
            copy = await self.traces.copy_for_turn(owner, continue_trace_id)
            if copy is not None:
                continue_trace_id, home = copy.trace_id, copy.home
            trace = await self.traces.get_trace(owner, continue_trace_id)
            # A cached copy of a peer's trace: its kind and agent are the peer's.
            if not trace.home and trace.kind != tp.TRACE_KIND_A2A:
                raise FailedPrecondition("continue_trace_id is not the trace of an agent-invoke call")
            if trace.agent != task.callee_agent:
                raise InvalidArgument(f"trace {continue_trace_id} belongs to agent {trace.agent!r}")
        submitted = tp.A2ATask()
        submitted.CopyFrom(task)
        submitted.state = tp.TASK_STATE_SUBMITTED
        created = await self.store.create_task(owner, submitted, continue_trace_id)
        if home:
            created.trace_id = home
        return created

    async def update_state(self, owner: str, task_id: str, state: int) -> tp.A2ATask:
        """Moves the task to `state`; a final state (completed, canceled, failed, rejected) stays."""
        need_enum(STATE, state, "state")
        need_owner(owner)
        need(task_id, "task_id")

        def move(current: tp.A2ATask) -> tp.A2ATask:
            if current.state != state and current.state in domain.FINAL_TASK_STATES:
                raise FailedPrecondition(f"task is already {enum_to_str(STATE, current.state)}")
            moved = tp.A2ATask()
            moved.CopyFrom(current)
            moved.state = state  # type: ignore[assignment]
            return moved

        return await self.store.update_task(owner, task_id, move)

    async def get(self, owner: str, task_id: str) -> tp.A2ATask:
        need_owner(owner)
        need(task_id, "task_id")
        return await self.store.get_task(owner, task_id)

    async def list_started(self, owner: str, caller_trace_id: str) -> list[tp.A2ATask]:
        """The tasks a caller trace started, oldest first."""
        need_owner(owner)
        need(caller_trace_id, "trace_id")
        return await self.store.list_tasks(owner, caller_trace_id)

    async def list_inbound(
        self, owner: str, query: InboundTaskQuery, page_size: int, page_token: str
    ) -> tuple[list[tp.A2ATask], str]:
        """A page of the owner's inbound tasks (A2A clients' calls), newest first, and the next page's
        token ("" on the last)."""
        need_owner(owner)
        size = domain.page_size(page_size)
        after = domain.cursor(page_token)
        if query.state:
            need_enum(STATE, query.state, "state")
        tasks = await self.store.list_inbound_tasks(owner, query, size + 1, after)
        if len(tasks) <= size:
            return tasks, ""
        last = tasks[size - 1]
        return tasks[:size], domain.encode_page_token(last.create_time.ToDatetime(UTC), last.id)
