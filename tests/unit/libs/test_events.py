"""libs.events and libs.protojson: the browser JSON of events and the one builder of subagent cards."""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import ModelError
from agentmesh.libs.protojson import enum_to_str, str_to_enum, to_json
from agentmesh.trace.v1 import trace_pb2 as tp


def row(i: int, status: int, call: str = "call-1", **kw: object) -> tp.SubagentSession:
    made = timestamp_pb2.Timestamp(seconds=1_700_000_000 + i)
    return tp.SubagentSession(
        id=f"sub{i}",
        trace_id="t",
        parent_message_id=7,
        parent_tool_call_id=call,
        batch_title=f"batch {call}",
        name=f"n{i}",
        goal=f"g{i}",
        status=status,  # type: ignore[arg-type]
        sort_order=i,
        source_type=ev.SUBAGENT_SOURCE_PRESET,
        child_trace_id=f"child{i}",
        model="m",
        create_time=made,
        **kw,  # type: ignore[arg-type]
    )


def test_event_json() -> None:
    delta = events.text_delta("hi")
    delta.offset = "00001"
    assert events.to_dict(delta, with_offset=True) == {
        "type": "text-delta",
        "textDelta": "hi",
        "offset": "00001",
    }
    assert events.to_dict(events.error(ModelError("boom"))) == {
        "type": "error",
        "code": "model_error",
        "message": "boom",
    }
    assert events.to_dict(events.done()) == {"type": "done"}
    finish = ev.Event(finish=ev.TurnFinish(finish_reason=ev.FINISH_REASON_MAX_STEPS, model="m"))
    assert events.to_dict(finish) == {"type": "finish", "finishReason": "max-steps", "model": "m"}
    assert events.is_terminal(events.done()) and not events.is_terminal(delta)
    assert events.type_name(ev.Event(a2a_task_started=ev.A2ATaskStarted())) == "a2a-task-started"


def test_enum_names_round_trip() -> None:
    for enum in (ev.SubagentStatus, ev.FinishReason, ev.ErrorCode, tp.TaskState, tp.TraceKind):
        for value in enum.DESCRIPTOR.values[1:]:
            name = enum_to_str(enum.DESCRIPTOR, value.number)
            assert name and str_to_enum(enum.DESCRIPTOR, name) == value.number
    assert enum_to_str(tp.TaskState.DESCRIPTOR, tp.TASK_STATE_INPUT_REQUIRED) == "input-required"
    assert enum_to_str(ev.ErrorCode.DESCRIPTOR, ev.ERROR_CODE_DEPTH_EXCEEDED) == "depth_exceeded"


def test_the_live_card_and_the_stored_card_are_the_same_json() -> None:
    done = row(0, ev.SUBAGENT_STATUS_COMPLETED, summary="", error="")
    live = events.to_dict(
        ev.Event(subagent_update=ev.SubagentUpdate(parent_message_id=7, subagent=events.item_from_row(done)))
    )
    stored = events.batches_json([done])[0]["items"][0]
    assert live["subagent"] == stored
    fields = "id name sourceType status goal summary error tokenUsage sortOrder childTraceId model background"
    assert set(stored) == set(fields.split())
    assert stored["summary"] == "" and stored["error"] == "" and stored["model"] == "m", "empty fields stay"


def test_batches_group_by_call_in_creation_order_and_count_every_status() -> None:
    rows = [
        row(3, ev.SUBAGENT_STATUS_CANCELLED, "call-2"),
        row(0, ev.SUBAGENT_STATUS_COMPLETED),
        row(2, ev.SUBAGENT_STATUS_RUNNING),
        row(1, ev.SUBAGENT_STATUS_FAILED),
    ]
    batches = events.batches_json(rows)
    assert [b["toolCallId"] for b in batches] == ["call-1", "call-2"]
    assert [i["id"] for i in batches[0]["items"]] == ["sub0", "sub1", "sub2"]
    assert batches[0]["summary"] == {"total": 3, "completed": 1, "running": 1, "failed": 1, "cancelled": 0}
    assert batches[1]["summary"] == {"total": 1, "completed": 0, "running": 0, "failed": 0, "cancelled": 1}
    assert batches[0]["title"] == "batch call-1" and batches[0]["parentMessageId"] == 7
    assert to_json(events.summarize([])) == {
        "total": 0,
        "completed": 0,
        "running": 0,
        "failed": 0,
        "cancelled": 0,
    }
