"""Our buffer's events as A2A events: the one mapping of the executor (live) and of SubscribeToTask
(replay), so both stream the same events with the same offsets."""

from __future__ import annotations

from a2a.types import a2a_pb2 as a2a
from google.protobuf import struct_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.a2a import OFFSET_KEY, RESPONSE_ARTIFACT, USAGE_KEY
from agentmesh.libs.errors import code_name

A2AEvent = a2a.TaskStatusUpdateEvent | a2a.TaskArtifactUpdateEvent


def _meta(event: ev.Event, **more: object) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.update({OFFSET_KEY: event.offset, **more})
    return meta


def agent_text(text: str, task_id: str, context_id: str) -> a2a.Message:
    return a2a.Message(
        message_id=f"{task_id}-status",
        role=a2a.ROLE_AGENT,
        parts=[a2a.Part(text=text)],
        task_id=task_id,
        context_id=context_id,
    )


def status(state: int, task_id: str, context_id: str, text: str = "") -> a2a.TaskStatus:
    out = a2a.TaskStatus(state=state)  # type: ignore[arg-type]
    out.timestamp.GetCurrentTime()
    if text:
        out.message.CopyFrom(agent_text(text, task_id, context_id))
    return out


def to_a2a(event: ev.Event, task_id: str, context_id: str, *, first_text: bool = False) -> A2AEvent | None:
    """The A2A event of one of our events (None for those A2A has no word for: tool calls, reasoning,
    nested calls). `first_text`: this text delta opens the reply artifact (append=false)."""
    kind = events.kind(event)
    if kind == "text_delta":
        return a2a.TaskArtifactUpdateEvent(
            task_id=task_id,
            context_id=context_id,
            artifact=a2a.Artifact(
                artifact_id=RESPONSE_ARTIFACT,
                name="response",
                parts=[a2a.Part(text=event.text_delta.text_delta)],
            ),
            append=not first_text,
            metadata=_meta(event),
        )
    if kind == "start":
        return a2a.TaskStatusUpdateEvent(
            task_id=task_id,
            context_id=context_id,
            status=status(a2a.TASK_STATE_WORKING, task_id, context_id),
            metadata=_meta(event),
        )
    if kind == "finish":
        usage = {
            "inputTokens": event.finish.usage.input_tokens,
            "outputTokens": event.finish.usage.output_tokens,
        }
        return a2a.TaskStatusUpdateEvent(
            task_id=task_id,
            context_id=context_id,
            status=status(a2a.TASK_STATE_WORKING, task_id, context_id),
            metadata=_meta(event, **{USAGE_KEY: usage, "model": event.finish.model}),
        )
    if kind == "done":
        return a2a.TaskStatusUpdateEvent(
            task_id=task_id,
            context_id=context_id,
            status=status(a2a.TASK_STATE_COMPLETED, task_id, context_id),
            metadata=_meta(event),
        )
    if kind == "error":
        cancelled = event.error.code == ev.ERROR_CODE_CANCELLED
        state = a2a.TASK_STATE_CANCELED if cancelled else a2a.TASK_STATE_FAILED
        return a2a.TaskStatusUpdateEvent(
            task_id=task_id,
            context_id=context_id,
            status=status(state, task_id, context_id, event.error.message or code_name(event.error.code)),
            metadata=_meta(event, code=code_name(event.error.code)),
        )
    return None
