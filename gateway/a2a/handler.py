"""The a2a-sdk's DefaultRequestHandler over our executor and store, with two methods of its own where
the mesh does better than a handler whose tasks live in one process:

- SubscribeToTask replays the task's buffer `a2a:<task id>` from the stream service, on any replica:
  from the start (after the task's snapshot, as the SDK does), or, with `Last-Event-ID: <offset>` (the
  `metadata.offset` of the last event the client saw), after that offset, so a resubscription after a
  dropped connection loses and repeats nothing, also once the task has ended while the buffer lives.
- CancelTask closes the buffer with `cancelled`: the replica that runs the turn sees it and cancels the
  turn and every run under it; the task row is settled canceled here at once, so a task whose runner
  died is settled too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

from a2a.server.context import ServerCallContext
from a2a.server.events import Event
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.request_handlers.request_handler import validate_request_params
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError, UnsupportedOperationError
from a2a.utils.task import apply_history_length, validate_history_length

from agentmesh.gateway.a2a.calls import header
from agentmesh.gateway.a2a.events import to_a2a
from agentmesh.gateway.a2a.executor import InboundTasks, MeshAgentExecutor
from agentmesh.gateway.a2a.push import PushMethods, PushParts
from agentmesh.gateway.a2a.store import MeshTaskStore
from agentmesh.gateway.drain import Drain
from agentmesh.libs import events
from agentmesh.libs.a2a import FINAL_A2A_STATES, RESUME_HEADER, to_a2a_state
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import NotFound, rpc
from agentmesh.libs.ids import a2a_key
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_OFFSET_CHARS = 64


def handler_card() -> a2a.AgentCard:
    """What the SDK's handler reads of a card: the capabilities (one for every agent of the mesh)."""
    return a2a.AgentCard(
        name="agentmesh",
        description="the agents of an agentmesh gateway",
        version="1",
        supported_interfaces=[
            a2a.AgentInterface(url="/a2a", protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        # push: the config methods answer (a refused URL names the allow-list setting)
        capabilities=a2a.AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[
            a2a.AgentSkill(id="agents", name="agents", description="every public agent", tags=["agentmesh"])
        ],
    )


class _TaskExists(logging.Filter):
    """Drops the SDK's "Task ... already exists. Ignoring task replacement." (an error-level line per
    task): our TaskStore has the row from the moment the request names the task (InboundTasks creates
    it), so the executor's first Task event, which the stream still needs, is always a replacement."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "already exists. Ignoring task replacement" not in record.getMessage()


logging.getLogger("a2a.server.agent_execution.active_task").addFilter(_TaskExists())


class MeshRequestHandler(PushMethods, DefaultRequestHandler):
    def __init__(self, clients: Clients, settings: MeshSettings, drain: Drain, default_agent: str) -> None:
        self.store = MeshTaskStore(clients)
        self.clients = clients
        self.settings = settings
        self.push = PushParts(clients, self.store, settings)
        super().__init__(
            agent_executor=MeshAgentExecutor(clients, settings, drain),
            task_store=self.store,
            agent_card=handler_card(),
            request_context_builder=InboundTasks(clients, default_agent),
            # configs only: the dispatch follows the task's buffer (gateway/a2a/push.py), not the
            # SDK's in-process events, so no push_sender here
            push_config_store=self.push.configs,
        )

    @validate_request_params
    async def on_get_task(self, params: a2a.GetTaskRequest, context: ServerCallContext) -> a2a.Task | None:
        validate_history_length(params)
        row = await self.store.row(params.id, context)
        if row is None:
            raise TaskNotFoundError
        return apply_history_length(await self.store.to_a2a(row, with_messages=True), params)

    @validate_request_params
    async def on_subscribe_to_task(  # type: ignore[override]
        self, params: a2a.SubscribeToTaskRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        row = await self.store.row(params.id, context)
        if row is None:
            raise TaskNotFoundError
        after = header(context, RESUME_HEADER).strip()[:MAX_OFFSET_CHARS]
        if not after:
            if to_a2a_state(row.state) in FINAL_A2A_STATES:
                raise UnsupportedOperationError(
                    message=f"Task {row.id} is in terminal state: {tp.TaskState.Name(row.state)}"
                )
            yield await self.store.to_a2a(row, with_messages=True)
        follow = self.clients.follows.follow(a2a_key(row.id), after, int(self.settings.turn_timeout_s * 1000))
        first_text = not after
        try:
            async for event in follow:
                out = to_a2a(event, row.id, row.trace_id, first_text=first_text)
                if out is not None:
                    first_text = first_text and not isinstance(out, a2a.TaskArtifactUpdateEvent)
                    yield out
                if events.is_terminal(event):
                    return
        except NotFound:
            # The buffer is gone (expired): what is left is the task as stored.
            yield await self.store.to_a2a(row, with_messages=True)
        finally:
            follow.cancel()

    @validate_request_params
    async def on_cancel_task(
        self, params: a2a.CancelTaskRequest, context: ServerCallContext
    ) -> a2a.Task | None:
        row = await self.store.row(params.id, context)
        if row is None:
            raise TaskNotFoundError
        if to_a2a_state(row.state) in FINAL_A2A_STATES:
            raise TaskNotCancelableError
        await rpc(self.clients.orchestrator.CancelTurn(orc.CancelTurnRequest(task_id=row.id)))
        return await self.store.get(row.id, context)
