"""An inbound A2A message is a task we serve, one turn of the orchestrator like every turn
(docs/design/turns.md, "A2A served"). `InboundTasks` (the SDK's RequestContextBuilder) asks for the
turn (RunTurn with an A2A caller) before the SDK picks ids, so the A2A task id is ours and the
contextId is our trace id (a follow-up naming it continues that trace); the task is the caller's (the
verified user of the API key). `MeshAgentExecutor` (the SDK's AgentExecutor) streams the turn's
buffer as A2A events, each with its offset. A cancel from any replica ends the buffer `cancelled`; the
orchestrator stops the turn and the tree under it, and the task's end follows from the buffer's.
"""

from __future__ import annotations

import logging

from a2a.server.agent_execution import AgentExecutor, RequestContext, SimpleRequestContextBuilder
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import InvalidParamsError, UnsupportedOperationError

from agentmesh.gateway.a2a.calls import INBOUND_KEY, addressed_agent, header
from agentmesh.gateway.a2a.events import status, to_a2a
from agentmesh.gateway.drain import Drain
from agentmesh.gateway.turns import Started, start_turn, turn_events
from agentmesh.libs import events, jsonbound, telemetry
from agentmesh.libs.a2a import TRACEPARENT_KEY, metadata_depth, metadata_str
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import InvalidArgument, MeshError, NotFound, rpc
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc

log = logging.getLogger(__name__)
MAX_INPUT_CHARS = 100_000


class InboundTasks(SimpleRequestContextBuilder):
    """Starts the turn of a message that starts a task (one that names no task id)."""

    def __init__(self, clients: Clients, default_agent: str) -> None:
        super().__init__(should_populate_referred_tasks=False, task_store=None)
        self.clients = clients
        self.default_agent = default_agent

    async def build(
        self,
        context: ServerCallContext,
        params: a2a.SendMessageRequest | None = None,
        task_id: str | None = None,
        context_id: str | None = None,
        task: a2a.Task | None = None,
    ) -> RequestContext:
        if params is None or task_id:
            return await super().build(context, params, task_id, context_id, task)
        slug = addressed_agent(context) or self.default_agent
        text = "\n".join(p.text for p in params.message.parts if p.WhichOneof("content") == "text")
        if not text.strip():
            raise InvalidParamsError(message="the message has no text part")
        if len(text) > MAX_INPUT_CHARS:
            raise InvalidParamsError(message=f"the message is longer than {MAX_INPUT_CHARS} characters")
        metadata = params.message.metadata
        try:  # refused before any task exists: the JSON bound, over gRPC too (libs/jsonbound.py)
            jsonbound.check(text, "the message's text")
            jsonbound.check_struct(metadata, "the message's metadata")
            depth = metadata_depth(metadata)
        except InvalidArgument as err:
            raise InvalidParamsError(message=err.message) from err
        request = orc.RunTurnRequest(
            trace_id=context_id or "",
            agent=slug,
            input=text,
            a2a=orc.A2ACaller(message_id=params.message.message_id, depth=depth),
        )
        # A traceparent header continued the trace already (the gateway's request span); a client that
        # sends one only in the message's metadata is continued here.
        in_header = header(context, TRACEPARENT_KEY)
        traceparent = "" if in_header else metadata_str(metadata, TRACEPARENT_KEY)
        try:
            with telemetry.continued(traceparent):
                started = await start_turn(self.clients, request)
        except NotFound as err:
            if context_id and not err.message.startswith("no public agent"):
                # another user's contextId answers like a missing one
                raise InvalidParamsError(message=f"unknown contextId {context_id!r}") from err
            raise InvalidParamsError(message=err.message) from err
        except MeshError as err:
            raise InvalidParamsError(message=err.message) from err
        context.state[INBOUND_KEY] = started
        begun = started.begun
        return await super().build(context, params, begun.task_id, begun.trace_id, task)


class MeshAgentExecutor(AgentExecutor):
    def __init__(self, clients: Clients, settings: MeshSettings, drain: Drain | None = None) -> None:
        self.clients = clients
        self.settings = settings
        self.drain = drain or Drain()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        started = context.call_context.state.get(INBOUND_KEY)
        if not isinstance(started, Started) or started.begun.task_id != context.task_id:
            raise UnsupportedOperationError(message="a task of this agent takes one message")
        begun = started.begun
        task_id, trace_id = begun.task_id, begun.trace_id
        message = context.message
        assert message is not None
        await event_queue.enqueue_event(
            a2a.Task(
                id=task_id,
                context_id=trace_id,
                status=status(a2a.TASK_STATE_SUBMITTED, task_id, trace_id),
                history=[message],
            )
        )
        try:
            await self._follow(started, event_queue)
        finally:
            started.close()  # a task's turn ends with its call: stopped, settled, if it still runs

    async def _follow(self, started: Started, queue: EventQueue) -> None:
        """The turn's events as A2A events until its terminal one, which ends the task."""
        task_id, trace_id = started.begun.task_id, started.begun.trace_id
        first_text = True
        async for event in turn_events(self.clients, started, self.drain):
            out = to_a2a(event, task_id, trace_id, first_text=first_text and not events.is_terminal(event))
            if out is not None:
                first_text = first_text and not isinstance(out, a2a.TaskArtifactUpdateEvent)
                await queue.enqueue_event(out)
            if events.is_terminal(event):
                return

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """The SDK's own cancel path (our handler cancels through the orchestrator instead)."""
        if context.task_id:
            await rpc(self.clients.orchestrator.CancelTurn(orc.CancelTurnRequest(task_id=context.task_id)))
            await event_queue.enqueue_event(
                a2a.TaskStatusUpdateEvent(
                    task_id=context.task_id,
                    context_id=context.context_id or "",
                    status=status(a2a.TASK_STATE_CANCELED, context.task_id, context.context_id or ""),
                )
            )
