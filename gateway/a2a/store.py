"""The a2a-sdk's TaskStore over the trace service: an A2A task is one of our A2A tasks (an `a2a_tasks`
row whose callee trace is the A2A contextId), read and moved as the calling user over gRPC. Only
inbound tasks are A2A's (those no session of this mesh started), and only those of the agent the
request addresses: anything else answers exactly like a missing task."""

from __future__ import annotations

from a2a.server.context import ServerCallContext
from a2a.server.tasks import TaskStore
from a2a.types import a2a_pb2 as a2a
from a2a.utils.errors import InvalidParamsError

from agentmesh.gateway.a2a.calls import addressed_agent
from agentmesh.gateway.a2a.events import agent_text
from agentmesh.libs.a2a import RESPONSE_ARTIFACT, from_a2a_state, to_a2a_state
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import InvalidArgument, NotFound, rpc
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp


class MeshTaskStore(TaskStore):
    def __init__(self, clients: Clients) -> None:
        self.clients = clients

    async def row(self, task_id: str, context: ServerCallContext | None) -> tp.A2ATask | None:
        """Our task row, or None when it is missing, another user's, not inbound or another agent's."""
        try:
            task = (await rpc(self.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task_id)))).task
        except (NotFound, InvalidArgument):
            return None
        slug = addressed_agent(context)
        if task.caller_trace_id or (slug and task.callee_agent != slug):
            return None
        return task

    async def save(self, task: a2a.Task, context: ServerCallContext) -> None:
        """Nothing: the orchestrator owns the task's state (the SDK's copy follows from our events)."""

    async def get(self, task_id: str, context: ServerCallContext) -> a2a.Task | None:
        """The task's state (the SDK reads it on every start and cancel; GetTask adds the messages:
        MeshRequestHandler.on_get_task)."""
        row = await self.row(task_id, context)
        return None if row is None else await self.to_a2a(row, with_messages=False)

    async def list(self, params: a2a.ListTasksRequest, context: ServerCallContext) -> a2a.ListTasksResponse:
        try:
            resp = await rpc(
                self.clients.tasks.ListA2ATasks(
                    tks.ListA2ATasksRequest(
                        callee_agent=addressed_agent(context),
                        trace_id=params.context_id,
                        state=from_a2a_state(params.status),
                        page_size=params.page_size,
                        page_token=params.page_token,
                    )
                )
            )
        except InvalidArgument as err:  # a pageToken we did not issue, a page size out of range
            raise InvalidParamsError(message=err.message) from err
        full = params.include_artifacts or params.history_length > 0
        tasks = [await self.to_a2a(row, with_messages=full) for row in resp.tasks]
        whole = not params.page_token and not resp.next_page_token  # one page holds them all
        return a2a.ListTasksResponse(
            tasks=tasks,
            next_page_token=resp.next_page_token,
            page_size=len(tasks),
            total_size=len(tasks) if whole else 0,
        )

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        """Tasks go with their trace (DELETE /api/sessions/...); A2A has no delete."""

    async def to_a2a(self, row: tp.A2ATask, *, with_messages: bool) -> a2a.Task:
        """An A2A Task of our row: its state, and (`with_messages`) its messages as history and the
        reply as the `response` artifact."""
        state = to_a2a_state(row.state)
        task = a2a.Task(id=row.id, context_id=row.trace_id, status=a2a.TaskStatus(state=state))
        task.status.timestamp.CopyFrom(row.update_time)
        if not with_messages:
            return task
        resp = await rpc(
            self.clients.messages.ListMessages(
                ms.ListMessagesRequest(trace_id=row.trace_id, mode=ms.PATH_MODE_ALL, limit=1000)
            )
        )
        for message in resp.messages:
            if message.a2a_task_id != row.id:
                continue
            agent = message.role == tp.MESSAGE_ROLE_ASSISTANT
            task.history.append(
                a2a.Message(
                    message_id=f"{row.id}-{message.sequence}",
                    role=a2a.ROLE_AGENT if agent else a2a.ROLE_USER,
                    parts=[a2a.Part(text=message.content)],
                    task_id=row.id,
                    context_id=row.trace_id,
                )
            )
            if agent and message.content:
                task.artifacts.append(
                    a2a.Artifact(
                        artifact_id=RESPONSE_ARTIFACT, name="response", parts=[a2a.Part(text=message.content)]
                    )
                )
            if agent and state in (a2a.TASK_STATE_FAILED, a2a.TASK_STATE_CANCELED):
                error = message.metadata.fields.get("error")
                if error is not None and error.WhichOneof("kind") == "struct_value":
                    text = error.struct_value.fields.get("message")
                    if text is not None and text.string_value:
                        task.status.message.CopyFrom(agent_text(text.string_value, row.id, row.trace_id))
        return task
