"""What a turn streamed before it failed, read back from its buffer, so that a failed or cancelled
turn loses none of it: its text, its reasoning and its tool calls (docs/design/turns.md, "Failure")."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.clients import Clients
from agentmesh.libs.errors import MeshError, from_event
from agentmesh.libs.protojson import to_json
from agentmesh.trace.v1 import trace_pb2 as tp

log = logging.getLogger(__name__)
READ_BACK_IDLE_MS = 200  # a buffer still open (its writer died) is read to its last event


@dataclass
class Partial:
    """A run's events folded into what its placeholder keeps."""

    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    calls: dict[str, dict[str, Any]] = field(default_factory=dict)
    step: int = 0
    _after_output: bool = False

    def see(self, event: ev.Event) -> None:
        which = events.kind(event)
        if which == "text_delta":
            self.text.append(event.text_delta.text_delta)
        elif which == "reasoning_delta":
            self.thinking.append(event.reasoning_delta.reasoning_delta)
        elif which == "tool_input_available":
            if self._after_output:  # the first call of the next model step
                self.step += 1
                self._after_output = False
            data = to_json(event.tool_input_available)
            self.calls[data["toolCallId"]] = {
                "id": data["toolCallId"],
                "name": data["toolName"],
                "input": data.get("input"),
                "output": {"ok": False, "error": "the turn ended before the tool did"},
                "ok": False,
                "step": self.step,
            }
        elif which == "tool_output_available":
            data = to_json(event.tool_output_available)
            call = self.calls.get(data["toolCallId"])
            if call is not None:
                meta = {**call.get("metadata", {}), **data.get("metadata", {})}
                call.update(output=data.get("output"), ok=data["ok"], metadata=meta, done=True)
            self._after_output = True
        elif which == "a2a_task_started":  # a callee of a call: it can be opened from the history
            started = event.a2a_task_started
            call = self.calls.get(started.tool_call_id)
            if call is not None:
                meta = call.setdefault("metadata", {})
                meta.setdefault("taskIds", []).append(started.task_id)
                meta.setdefault("traceIds", []).append(started.trace_id)
                if len(meta["taskIds"]) == 1:
                    meta.update(taskId=started.task_id, traceId=started.trace_id)
                    if started.local_trace_id:  # a remote callee: our record of the exchange
                        meta.update(localTraceId=started.local_trace_id)

    def message(self, message_id: int, status: int, err: MeshError) -> tp.Message:
        """The placeholder as the failed turn leaves it: what streamed, the status and the error."""
        msg = tp.Message(
            id=message_id,
            content="".join(self.text),
            thinking="".join(self.thinking),
            status=status,  # type: ignore[arg-type]
        )
        metadata: dict[str, Any] = {"error": {"code": err.code_name, "message": err.message}}
        if self.calls:
            # Each call says how it ended: a call the turn's end cut off ended as the turn did.
            cut = "cancelled" if status == tp.MESSAGE_STATUS_CANCELLED else "failed"
            metadata["toolCalls"] = [
                {k: v for k, v in call.items() if k != "done"}
                | {"status": ("completed" if call["ok"] else "failed") if call.get("done") else cut}
                for call in self.calls.values()
            ]
        msg.metadata.update(metadata)
        return msg


async def read_back(clients: Clients, key: str, after: str, within_s: float) -> Partial:
    """What a run streamed into `key` after offset `after`, replayed to the buffer's end (or its last
    event, once nothing more comes for a moment)."""
    partial = Partial()
    follow = clients.follows.follow(key, after, READ_BACK_IDLE_MS)
    try:
        async with asyncio.timeout(within_s):
            async for event in follow:
                if events.is_terminal(event):
                    break
                partial.see(event)
    except (MeshError, TimeoutError) as exc:
        log.warning("could not read back what %s streamed: %s", key, exc, extra={"key": key})
    finally:
        follow.cancel()
    return partial


async def ended_by(clients: Clients, key: str, within_s: float) -> MeshError | None:
    """The error `key` was ended with by someone else (a cancel, a lease that ran out); None when it
    did not end with one (still open after a moment, ended `done`, or unreadable)."""
    follow = clients.follows.follow(key, "", READ_BACK_IDLE_MS, terminal_only=True)
    try:
        async with asyncio.timeout(within_s):
            async for event in follow:
                return from_event(event.error) if event.HasField("error") else None
    except (MeshError, TimeoutError):
        pass
    finally:
        follow.cancel()
    return None
