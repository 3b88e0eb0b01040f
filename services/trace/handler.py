"""The trace domain over its stores: what crosses resources. Everything else is one store call."""

from __future__ import annotations

from collections import defaultdict

from agentmesh.libs import events
from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import TraceRef
from agentmesh.services.trace.store.base import (
    AgentStore,
    MessagePage,
    MessageQuery,
    SubagentStore,
    TaskStore,
    TraceStore,
)
from agentmesh.services.trace.store.hybrid import HybridTraceStore
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts


class TraceHandler:
    def __init__(
        self,
        traces: TraceStore,
        tasks: TaskStore,
        subagents: SubagentStore,
        agents: AgentStore | None = None,
    ) -> None:
        self.traces = traces
        self.tasks = tasks
        self.subagents = subagents
        self.agents = agents

    async def begin_turn(self, owner: str, request: ts.BeginTurnRequest) -> ts.BeginTurnResponse:
        """The turn's user message and placeholder (and its new trace), stored together."""
        out = ts.BeginTurnResponse()
        messages = [request.user_message, request.assistant_message]
        if request.HasField("new_trace"):
            if request.HasField("parent_sequence"):
                raise InvalidArgument("a new trace has no message to follow")
            trace, (user, placeholder) = await self.traces.create_trace_with_messages(
                owner, request.new_trace, request.trace_id, messages
            )
            out.trace.CopyFrom(trace)
        else:
            parent = request.parent_sequence if request.HasField("parent_sequence") else None
            user, placeholder = await self.traces.append_messages(owner, request.trace_id, messages, parent)
        out.user_message.CopyFrom(user)
        out.assistant_message.CopyFrom(placeholder)
        return out

    async def create_task(self, owner: str, task: tp.A2ATask, continue_trace_id: str) -> tp.A2ATask:
        """An agent-invoke task; continuing a peer's trace (continueFrom @alias/id) runs the callee on
        our cached copy of it (synced now), and the task names the trace by its home id."""
        copy = None
        if continue_trace_id and isinstance(self.traces, HybridTraceStore):
            copy = await self.traces.copy_for_turn(owner, continue_trace_id)
        if copy is None:
            return await self.tasks.create_task(owner, task, continue_trace_id)
        created = await self.tasks.create_task(owner, task, copy[0])
        created.trace_id = copy[1]
        return created

    async def list_messages(self, owner: str, query: MessageQuery, view: int) -> MessagePage:
        """A page of messages; in MESSAGE_VIEW_FULL an assistant message whose metadata lacks
        `subagents` gets its batches rebuilt from the rows anchored to it
        (docs/requirements.md#subagent-history-restore)."""
        page = await self.traces.list_messages(owner, query)
        if view == ts.MESSAGE_VIEW_FULL and TraceRef.parse(query.trace_id).is_local:
            await self._restore_subagents(owner, query.trace_id, page.messages)
        return page

    async def _restore_subagents(self, owner: str, trace_id: str, messages: list[tp.Message]) -> None:
        lacking = [
            m
            for m in messages
            if m.role == tp.MESSAGE_ROLE_ASSISTANT and "subagents" not in m.metadata.fields
        ]
        if not lacking:
            return
        by_anchor: dict[int, list[tp.SubagentSession]] = defaultdict(list)
        for row in await self.subagents.list_subagents(owner, trace_id):
            by_anchor[row.parent_message_id].append(row)
        for message in lacking:
            rows = by_anchor.get(message.id)
            if rows:  # beside what the metadata holds (ParseDict would replace it whole)
                message.metadata.update({"subagents": events.batches_json(rows)})
