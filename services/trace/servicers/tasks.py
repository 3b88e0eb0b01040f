"""TaskService: a thin gRPC adapter from protobuf to the TaskHandler, errors through the one table
(libs/errors.py). The acting user comes from the call's verified identity, never from the request."""

from __future__ import annotations

from typing import TypeAlias

import grpc

from agentmesh.libs.errors import grpc_errors
from agentmesh.libs.identity import current_user
from agentmesh.services.trace.handlers.tasks import TaskHandler
from agentmesh.services.trace.store.base import InboundTaskQuery
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import task_service_pb2_grpc

Ctx: TypeAlias = grpc.aio.ServicerContext


class TaskServicer(task_service_pb2_grpc.TaskServiceServicer):
    def __init__(self, tasks: TaskHandler) -> None:
        self.tasks = tasks

    @grpc_errors
    async def CreateA2ATask(
        self, request: tks.CreateA2ATaskRequest, context: Ctx
    ) -> tks.CreateA2ATaskResponse:
        task = await self.tasks.create(current_user(), request.task, request.continue_trace_id)
        return tks.CreateA2ATaskResponse(task=task)

    @grpc_errors
    async def UpdateA2ATask(
        self, request: tks.UpdateA2ATaskRequest, context: Ctx
    ) -> tks.UpdateA2ATaskResponse:
        task = await self.tasks.update_state(current_user(), request.task_id, request.state)
        return tks.UpdateA2ATaskResponse(task=task)

    @grpc_errors
    async def GetA2ATask(self, request: tks.GetA2ATaskRequest, context: Ctx) -> tks.GetA2ATaskResponse:
        return tks.GetA2ATaskResponse(task=await self.tasks.get(current_user(), request.task_id))

    @grpc_errors
    async def ListA2ATasks(self, request: tks.ListA2ATasksRequest, context: Ctx) -> tks.ListA2ATasksResponse:
        if request.caller_trace_id:
            tasks = await self.tasks.list_started(current_user(), request.caller_trace_id)
            return tks.ListA2ATasksResponse(tasks=tasks)
        query = InboundTaskQuery(
            callee_agent=request.callee_agent, trace_id=request.trace_id, state=request.state
        )
        tasks, token = await self.tasks.list_inbound(
            current_user(), query, request.page_size, request.page_token
        )
        return tks.ListA2ATasksResponse(tasks=tasks, next_page_token=token)
