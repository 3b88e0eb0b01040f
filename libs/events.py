"""The event vocabulary: builders for the protobuf `Event` oneof and its browser JSON form."""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2

from agentmesh.v1 import events_pb2 as ev
from libs.protojson import to_json

TERMINAL = ("done", "error")


def kind(event: ev.Event) -> str:
    """The oneof field set: "text_delta", "a2a_task_started", ...; "" when empty."""
    return event.WhichOneof("payload") or ""


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


def error(code: str, message: str) -> ev.Event:
    return ev.Event(error=ev.Error(code=code, message=message))


def done() -> ev.Event:
    return ev.Event(done=ev.Done())
