"""The event vocabulary: builders for the protobuf `Event` oneof, its browser JSON form, and the
subagent cards (docs/requirements.md#subagent-history-restore), built from stored rows by one function
for the live card,
the anchor's `metadata.subagents` and the history restore alike."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf import struct_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import MeshError
from agentmesh.libs.protojson import to_json
from agentmesh.trace.v1 import trace_pb2 as tp

TERMINAL = ("done", "error")


def kind(event: ev.Event) -> str:
    """The oneof field set: "text_delta", "a2a_task_started", ...; "" when empty."""
    return event.WhichOneof("payload") or ""


def is_terminal(event: ev.Event) -> bool:
    return kind(event) in TERMINAL


def type_name(event: ev.Event) -> str:
    """The browser `type`: "text-delta", "a2a-task-started", ..."""
    return kind(event).replace("_", "-")


def to_dict(event: ev.Event, with_offset: bool = False) -> dict[str, Any]:
    """`{"type": "text-delta", "textDelta": "..."}` (plus `offset` when asked)."""
    which = kind(event)
    if which == "text_delta":  # the hot path: most events of a turn
        out_fast: dict[str, Any] = {"type": "text-delta", "textDelta": event.text_delta.text_delta}
        if with_offset:
            out_fast["offset"] = event.offset
        return out_fast
    body = to_json(getattr(event, which)) if which else {}
    out: dict[str, Any] = {"type": which.replace("_", "-"), **body}
    if with_offset:
        out["offset"] = event.offset
    return out


def value(data: Any) -> struct_pb2.Value:
    v = struct_pb2.Value()
    if data is None:
        v.null_value = struct_pb2.NULL_VALUE
    elif isinstance(data, bool):
        v.bool_value = data
    elif isinstance(data, int | float):
        v.number_value = data
    elif isinstance(data, str):
        v.string_value = data
    elif isinstance(data, dict):
        v.struct_value.update(data)
    elif isinstance(data, list | tuple):
        v.list_value.extend(list(data))
    else:
        v.string_value = str(data)
    return v


def struct(data: dict[str, Any] | None) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    if data:
        s.update(data)
    return s


def text_delta(text: str) -> ev.Event:
    return ev.Event(text_delta=ev.TextDelta(text_delta=text))


def reasoning_delta(text: str) -> ev.Event:
    return ev.Event(reasoning_delta=ev.ReasoningDelta(reasoning_delta=text))


def error(err: MeshError) -> ev.Event:
    return ev.Event(error=err.to_event())


def done() -> ev.Event:
    return ev.Event(done=ev.StreamDone())


# ---- subagent cards -------------------------------------------------------------------------------


def item_from_row(row: tp.SubagentSession) -> ev.SubagentItem:
    """The card of one subagent row."""
    return ev.SubagentItem(
        id=row.id,
        name=row.name,
        source_type=row.source_type,
        status=row.status,
        goal=row.goal,
        summary=row.summary,
        error=row.error,
        token_usage=row.token_usage,
        sort_order=row.sort_order,
        child_trace_id=row.child_trace_id,
        model=row.model,
        background=row.background,
    )


def summarize(statuses: Iterable[int]) -> ev.SubagentSummary:
    s = ev.SubagentSummary()
    for status in statuses:
        s.total += 1
        if status == ev.SUBAGENT_STATUS_COMPLETED:
            s.completed += 1
        elif status in (ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_RUNNING):
            s.running += 1
        elif status == ev.SUBAGENT_STATUS_CANCELLED:
            s.cancelled += 1
        else:
            s.failed += 1
    return s


def build_batches(rows: Iterable[tp.SubagentSession]) -> list[ev.SubagentBatch]:
    """The rows of one anchor -> one batch per delegate tool call, in creation order."""
    groups: dict[str, list[tp.SubagentSession]] = {}
    for row in sorted(rows, key=lambda r: (r.create_time.ToNanoseconds(), r.sort_order)):
        groups.setdefault(row.parent_tool_call_id or f"row-{row.id}", []).append(row)
    batches = []
    for members in groups.values():
        members.sort(key=lambda r: r.sort_order)
        first = members[0]
        batches.append(
            ev.SubagentBatch(
                parent_message_id=first.parent_message_id,
                title=first.batch_title,
                tool_call_id=first.parent_tool_call_id,
                items=[item_from_row(r) for r in members],
                summary=summarize(r.status for r in members),
            )
        )
    return batches


def batches_json(rows: Iterable[tp.SubagentSession]) -> list[dict[str, Any]]:
    """`metadata.subagents` of an anchor: its batches as browser JSON."""
    return [to_json(b) for b in build_batches(rows)]
