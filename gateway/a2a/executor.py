"""An inbound A2A message is one of our A2A tasks, run like an agent-invoke callee: `InboundTasks`
(the SDK's RequestContextBuilder) creates the task row and its hidden trace of source a2a, owned by
the caller (the verified user of the API key), before the SDK picks ids, so the A2A task id is ours
and the contextId is our trace id (a follow-up naming it continues that trace). `MeshAgentExecutor`
(the SDK's AgentExecutor) creates `a2a:<task id>`, runs the turn through the orchestrator
(`RunTurn`, the turn engine of every turn: messages persisted with source a2a and the task id) and
streams the buffer's events as A2A events, each with its offset. A cancel from any replica closes the
buffer with `cancelled`; the executor that runs the turn sees it and cancels the turn, and with it the
tree under it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import grpc
from a2a.server.agent_execution import AgentExecutor, RequestContext, SimpleRequestContextBuilder
from a2a.server.context import ServerCallContext
from a2a.server.events import EventQueue
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import InvalidParamsError, UnsupportedOperationError

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.gateway.a2a.calls import INBOUND_KEY, addressed_agent, header
from agentmesh.gateway.a2a.events import status, to_a2a
from agentmesh.libs import events, telemetry
from agentmesh.libs.a2a import TRACEPARENT_KEY, metadata_depth, metadata_str
from agentmesh.libs.clients import Clients
from agentmesh.libs.config import MeshSettings
from agentmesh.libs.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    MeshError,
    NotFound,
    from_event,
    from_rpc_error,
    rpc,
)
from agentmesh.libs.ids import a2a_key
from agentmesh.libs.leases import LeaseKeeper
from agentmesh.libs.tools import A2A_CALLEE
from agentmesh.orchestrator.v1 import orchestrator_service_pb2 as orc
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.stream.v1 import stream_service_pb2 as ss
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
GRACE_S = 5.0  # the turn's own deadline fires first; RunTurn's is a backstop
MAX_INPUT_CHARS = 100_000


@dataclass
class Inbound:
    """What a new inbound task runs: the agent, our task row, and the caller's depth."""

    agent: ap.Agent
    task: tp.A2ATask
    depth: int


async def public_agent(clients: Clients, slug: str) -> ap.Agent | None:
    """The public agent `slug` as the calling user sees it (theirs or built-in), or None."""
    if not slug:
        return None
    try:
        agent = (await rpc(clients.agents.GetAgent(ag.GetAgentRequest(slug=slug)))).agent
    except (NotFound, InvalidArgument):
        return None
    return agent if agent.public and not agent.HasField("remote") else None


class InboundTasks(SimpleRequestContextBuilder):
    """Creates our task row for a message that starts a task (one that names no task id)."""

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
        agent = await public_agent(self.clients, slug)
        if agent is None:
            raise InvalidParamsError(message=f"no public agent {slug!r}")
        text = "\n".join(p.text for p in params.message.parts if p.WhichOneof("content") == "text")
        if not text.strip():
            raise InvalidParamsError(message="the message has no text part")
        if len(text) > MAX_INPUT_CHARS:
            raise InvalidParamsError(message=f"the message is longer than {MAX_INPUT_CHARS} characters")
        caller_context = {"via": "a2a", "messageId": params.message.message_id[:200]}
        row = tp.A2ATask(callee_agent=agent.slug, caller_context=events.struct(caller_context))
        try:
            created = await rpc(
                self.clients.tasks.CreateA2ATask(
                    tks.CreateA2ATaskRequest(task=row, continue_trace_id=context_id or "")
                )
            )
        except (NotFound, InvalidArgument) as err:  # another user's contextId answers like a missing one
            raise InvalidParamsError(message=f"unknown contextId {context_id!r}") from err
        except MeshError as err:
            raise InvalidParamsError(message=err.message) from err
        context.state[INBOUND_KEY] = Inbound(agent, created.task, metadata_depth(params.message.metadata))
        return await super().build(context, params, created.task.id, created.task.trace_id, task)


class MeshAgentExecutor(AgentExecutor):
    def __init__(self, clients: Clients, settings: MeshSettings, leases: LeaseKeeper) -> None:
        self.clients = clients
        self.settings = settings
        self.leases = leases

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        inbound = context.call_context.state.get(INBOUND_KEY)
        if not isinstance(inbound, Inbound) or inbound.task.id != context.task_id:
            raise UnsupportedOperationError(message="a task of this agent takes one message")
        task, agent = inbound.task, inbound.agent
        message = context.message
        assert message is not None
        await event_queue.enqueue_event(
            a2a.Task(
                id=task.id,
                context_id=task.trace_id,
                status=status(a2a.TASK_STATE_SUBMITTED, task.id, task.trace_id),
                history=[message],
            )
        )
        # A traceparent header continued the trace already (the gateway's request span); a client that
        # sends one only in the message's metadata is continued here.
        in_header = header(context.call_context, TRACEPARENT_KEY)
        traceparent = "" if in_header else metadata_str(message.metadata, TRACEPARENT_KEY)
        key = a2a_key(task.id)
        with self.leases.hold(task=task.id, stream=key), telemetry.continued(traceparent):
            metadata = {"agent": agent.slug, "model": agent.model, "kind": "a2a", "taskId": task.id}
            await rpc(self.clients.stream.CreateStream(ss.CreateStreamRequest(key=key, metadata=metadata)))
            spec = orc.RunTurnRequest(
                trace_id=task.trace_id,
                agent=agent.slug,
                user_text=context.get_user_input(),
                stream_key=key,
                stream_created=True,
                role=A2A_CALLEE,
                depth=inbound.depth,
                source=tp.MESSAGE_SOURCE_A2A,
                a2a_task_id=task.id,
                timeout_ms=agent.limits.timeout_ms,
                overrides=rt.RunOverrides(model=agent.model),
            )
            turn = asyncio.create_task(self._turn(spec), name=f"a2a-turn:{task.id}")
            try:
                await self._follow(key, task, event_queue, turn, self._deadline_s(spec))
            except asyncio.CancelledError:
                await self._close(key, Cancelled("the task was cancelled"))
                raise
            finally:
                if not turn.done():
                    turn.cancel()
                await asyncio.gather(turn, return_exceptions=True)

    def _deadline_s(self, spec: orc.RunTurnRequest) -> float:
        return spec.timeout_ms / 1000 + GRACE_S if spec.timeout_ms else self.settings.turn_timeout_s

    async def _turn(self, spec: orc.RunTurnRequest) -> MeshError | None:
        """The turn to its end: None when it completed, else why not. A turn that could not run ends its
        buffer here (the turn engine ends it when it ran)."""
        try:
            resp = await self.clients.orchestrator.RunTurn(spec, timeout=self._deadline_s(spec))
        except grpc.aio.AioRpcError as exc:
            err = from_rpc_error(exc)
            await self._close(spec.stream_key, err)
            return err
        return None if resp.HasField("result") else from_event(resp.error)

    async def _close(self, key: str, err: MeshError) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.clients.stream.CloseStream(ss.CloseStreamRequest(key=key, error=err.to_event()))

    async def _follow(
        self,
        key: str,
        task: tp.A2ATask,
        queue: EventQueue,
        turn: asyncio.Task[MeshError | None],
        deadline_s: float,
    ) -> None:
        """The buffer's events as A2A events until its terminal one, which ends the task."""
        first_text = True
        follow = self.clients.follows.follow(key, idle_timeout_ms=int(deadline_s * 1000))
        try:
            async with asyncio.timeout(deadline_s + GRACE_S):
                async for event in follow:
                    if events.is_terminal(event):
                        if event.HasField("error") and event.error.code == ev.ERROR_CODE_CANCELLED:
                            turn.cancel()  # closed by a CancelTask on another replica: stop the tree
                        await asyncio.gather(turn, return_exceptions=True)
                        out = to_a2a(event, task.id, task.trace_id)
                        assert out is not None
                        await queue.enqueue_event(out)
                        return
                    out = to_a2a(event, task.id, task.trace_id, first_text=first_text)
                    if out is not None:
                        first_text = first_text and not isinstance(out, a2a.TaskArtifactUpdateEvent)
                        await queue.enqueue_event(out)
        except MeshError as exc:
            err: MeshError = exc
        except TimeoutError:
            err = DeadlineExceeded(f"the task did not end within {deadline_s + GRACE_S:g} s")
        else:
            err = Internal("the task's stream ended without a terminal event")
        finally:
            follow.cancel()
        turn.cancel()
        await self._close(key, err)
        await queue.enqueue_event(
            a2a.TaskStatusUpdateEvent(
                task_id=task.id,
                context_id=task.trace_id,
                status=status(a2a.TASK_STATE_FAILED, task.id, task.trace_id, err.message),
            )
        )

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        """The SDK's own cancel path (our handler cancels through the buffer instead)."""
        if context.task_id:
            await self._close(a2a_key(context.task_id), Cancelled("cancelled by the caller"))
            await event_queue.enqueue_event(
                a2a.TaskStatusUpdateEvent(
                    task_id=context.task_id,
                    context_id=context.context_id or "",
                    status=status(a2a.TASK_STATE_CANCELED, context.task_id, context.context_id or ""),
                )
            )
