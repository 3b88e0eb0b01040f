"""Turns whose owner went away (docs/design/turns.md, "When a process dies"). The orchestrator that ran
a turn settles it when its run fails; when that orchestrator itself dies, the runtime running the turn
learns it first (its run's call vanished): it ends the buffer and asks any orchestrator to settle the
rest, here, through the same settling steps as the engine's."""

from __future__ import annotations

import asyncio
import logging

from google.protobuf import field_mask_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import Interrupted, InvalidArgument, MeshError, NotFound, rpc
from agentmesh.libs.ids import parse_stream_key
from agentmesh.runtime.v1 import runtime_service_pb2 as rt
from agentmesh.services.orchestrator.partial import READ_BACK_IDLE_MS, read_back
from agentmesh.services.orchestrator.turns import TurnEngine
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
OPEN_TASK = (tp.TASK_STATE_SUBMITTED, tp.TASK_STATE_WORKING)
OPEN_SUBAGENT = (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING)


class Orphans:
    def __init__(self, engine: TurnEngine) -> None:
        self.engine = engine
        self.clients = engine.clients

    async def end(self, ref: rt.StreamRef) -> bool:
        """Settles the turn writing `ref` as interrupted; False when it had ended already."""
        key = parse_stream_key(ref.key)
        if not ref.start_offset:
            raise InvalidArgument("the stream's start_offset is required")
        start = await self._start(ref)
        err = Interrupted("the process running this turn went away; what it streamed is kept")
        partial = await read_back(self.clients, ref.key, ref.start_offset, self.engine.grace_s)
        placeholder_id = start.start.assistant_message_id
        get = ms.GetMessageRequest(message_id=placeholder_id)
        placeholder = (await rpc(self.clients.messages.GetMessage(get))).message
        settled = placeholder.status == tp.MESSAGE_STATUS_PENDING
        if settled:
            message = await self.engine.settle(placeholder_id, partial, err)
            settled = message is not None
        if key.kind == "a2a":
            settled = await self._task(key.id) or settled
        elif key.kind == "subagent":
            settled = await self._subagent(key.id, "".join(partial.text), err) or settled
        await self.engine.close_buffer(ref.key, events.error(err), ref.start_offset)
        log.info("an orphaned turn settled", extra={"key": ref.key, "settled": settled})
        return settled

    async def _start(self, ref: rt.StreamRef) -> ev.Event:
        """The buffer's `start`, at the offset the runtime was given (NotFound otherwise)."""
        follow = self.clients.follows.follow(ref.key, "", READ_BACK_IDLE_MS)
        try:
            async with asyncio.timeout(self.engine.grace_s):
                async for event in follow:
                    if event.HasField("start") and event.offset == ref.start_offset:
                        return event
                    break
        except (MeshError, TimeoutError):
            pass
        finally:
            follow.cancel()
        raise NotFound(f"no turn starts at {ref.start_offset} in {ref.key}")

    async def _task(self, task_id: str) -> bool:
        task = (await rpc(self.clients.tasks.GetA2ATask(tks.GetA2ATaskRequest(task_id=task_id)))).task
        if task.state not in OPEN_TASK:
            return False
        request = tks.UpdateA2ATaskRequest(task_id=task_id, state=tp.TASK_STATE_FAILED)
        await rpc(self.clients.tasks.UpdateA2ATask(request))
        return True

    async def _subagent(self, subagent_id: str, text: str, err: MeshError) -> bool:
        get = sbs.GetSubagentSessionRequest(subagent_id=subagent_id)
        row = (await rpc(self.clients.subagents.GetSubagentSession(get))).subagent
        if row.status not in OPEN_SUBAGENT:
            return False
        change = tp.SubagentSession(
            id=subagent_id,
            status=ev.SUBAGENT_STATUS_FAILED,
            error=f"{err.code_name}: {err.message}",
            summary=text,
        )
        paths = ["status", "error", "summary"]
        request = sbs.UpdateSubagentSessionRequest(
            subagent=change, update_mask=field_mask_pb2.FieldMask(paths=paths)
        )
        await rpc(self.clients.subagents.UpdateSubagentSession(request))
        return True
