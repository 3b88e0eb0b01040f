"""services/trace/store/sql/common.py: ORM rows -> resource messages, field by field. The rows are built in
memory, as a query hands them back (SQLite's timestamps naive, in UTC); no database, no session."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from google.protobuf import struct_pb2, timestamp_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.trace.store.sql import common
from agentmesh.services.trace.store.sql.models import (
    A2ATaskRow,
    AgentRow,
    MessageRow,
    SubagentRow,
    TraceRow,
)
from agentmesh.trace.v1 import trace_pb2 as tp

CREATED = datetime(2026, 11, 30, 12, 0, 0, 123456)  # naive: UTC
UPDATED = datetime(2026, 11, 30, 13, 0, 0, tzinfo=UTC)
STARTED = datetime(2026, 11, 30, 14, 0, 1, tzinfo=timezone(timedelta(hours=1)))  # 13:00:01 UTC
ENDED = datetime(2026, 11, 30, 13, 30, 0, 5)


def _stamp(dt: datetime, nanos: int = 0) -> timestamp_pb2.Timestamp:
    """The Timestamp of a UTC wall time, computed independently of common.ts."""
    seconds = int((dt.replace(tzinfo=None) - datetime(1970, 1, 1)).total_seconds())
    return timestamp_pb2.Timestamp(seconds=seconds, nanos=nanos)


def _struct(data: dict) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.update(data)
    return out


def test_timestamps():
    assert common.ts(None) is None
    assert common.ts(CREATED) == _stamp(CREATED, 123_456_000)
    assert common.ts(UPDATED) == _stamp(UPDATED)
    assert common.ts(STARTED) == _stamp(datetime(2026, 11, 30, 13, 0, 1))
    assert common.ts(ENDED) == _stamp(datetime(2026, 11, 30, 13, 30, 0), 5_000)


@pytest.mark.parametrize(
    ("kind", "number"),
    [("chat", tp.TRACE_KIND_CHAT), ("a2a", tp.TRACE_KIND_A2A), ("subagent", tp.TRACE_KIND_SUBAGENT)],
)
def test_trace_pb(kind, number):
    row = TraceRow(
        id="t-1",
        user_id=7,
        agent="general",
        kind=kind,
        visible_in_sidebar=1,
        head_sequence=4,
        last_sequence=6,
        title="hello",
        created_at=CREATED,
        updated_at=UPDATED,
        deleted_at=None,
    )
    pb = common.trace_pb(row, "alice")
    assert pb.id == "t-1"
    assert pb.owner == "alice"  # the owner's name, given: the row has only the user's key
    assert pb.agent == "general"
    assert pb.kind == number
    assert pb.visible_in_sidebar is True
    assert pb.head_sequence == 4  # the head, not the allocation counter (last_sequence)
    assert pb.title == "hello"
    assert pb.create_time == _stamp(CREATED, 123_456_000)
    assert pb.update_time == _stamp(UPDATED)
    assert pb == tp.Trace(
        id="t-1",
        owner="alice",
        agent="general",
        kind=number,
        visible_in_sidebar=True,
        head_sequence=4,
        title="hello",
        create_time=_stamp(CREATED, 123_456_000),
        update_time=_stamp(UPDATED),
    )


def test_trace_pb_hidden_and_empty():
    row = TraceRow(
        id="t-2",
        user_id=1,
        agent="",
        kind="chat",
        visible_in_sidebar=0,
        head_sequence=0,
        title="",
        created_at=UPDATED,
        updated_at=UPDATED,
    )
    pb = common.trace_pb(row, "bob")
    assert (pb.visible_in_sidebar, pb.head_sequence, pb.agent, pb.title) == (False, 0, "", "")


def test_message_pb_every_field():
    row = MessageRow(
        id=41,
        trace_id="t-1",
        sequence=5,
        parent_sequence=3,
        role="assistant",
        content="answer",
        thinking="hmm",
        meta={"toolCalls": [{"id": "c1", "ok": True}], "n": 2},
        model="mock-gpt",
        input_tokens=11,
        output_tokens=22,
        sort_order=0,
        status="pending",
        source="a2a",
        a2a_task_id="task-9",
        caller_agent=AgentRow(slug="general"),
        caller_trace_id="caller-1",
        created_at=CREATED,
    )
    pb = common.message_pb(row)
    assert pb.id == 41
    assert pb.trace_id == "t-1"
    assert pb.sequence == 5
    assert pb.parent_sequence == 3
    assert pb.role == tp.MESSAGE_ROLE_ASSISTANT
    assert pb.content == "answer"
    assert pb.thinking == "hmm"
    assert pb.metadata == _struct({"toolCalls": [{"id": "c1", "ok": True}], "n": 2})
    assert pb.model == "mock-gpt"
    assert pb.usage == ev.Usage(input_tokens=11, output_tokens=22)
    assert pb.source == tp.MESSAGE_SOURCE_A2A
    assert pb.a2a_task_id == "task-9"
    assert pb.caller_agent == "general"  # the slug of the joined agent row
    assert pb.caller_trace_id == "caller-1"
    assert pb.status == tp.MESSAGE_STATUS_PENDING
    assert pb.create_time == _stamp(CREATED, 123_456_000)


def test_message_pb_nulls():
    """NULL columns become the proto defaults; a NULL metadata is an unset field, not an empty one."""
    row = MessageRow(
        id=1,
        trace_id="t-1",
        sequence=1,
        parent_sequence=None,  # a root
        role="user",
        content="",
        thinking="",
        meta=None,
        model="",
        input_tokens=0,
        output_tokens=0,
        status="completed",
        source="user",
        a2a_task_id=None,
        caller_agent=None,  # never set, or its agent was deleted (SET NULL)
        caller_trace_id=None,
        created_at=UPDATED,
    )
    pb = common.message_pb(row)
    assert pb == tp.Message(
        id=1,
        trace_id="t-1",
        sequence=1,
        role=tp.MESSAGE_ROLE_USER,
        usage=ev.Usage(),
        source=tp.MESSAGE_SOURCE_USER,
        status=tp.MESSAGE_STATUS_COMPLETED,
        create_time=_stamp(UPDATED),
    )
    assert not pb.HasField("metadata") and pb.HasField("usage")


@pytest.mark.parametrize(
    ("column", "value", "field", "number"),
    [
        ("role", "system", "role", tp.MESSAGE_ROLE_SYSTEM),
        ("source", "subagent", "source", tp.MESSAGE_SOURCE_SUBAGENT),
        ("status", "failed", "status", tp.MESSAGE_STATUS_FAILED),
        ("status", "cancelled", "status", tp.MESSAGE_STATUS_CANCELLED),
    ],
)
def test_message_pb_enums(column, value, field, number):
    values = {"role": "user", "source": "user", "status": "completed", column: value}
    row = MessageRow(
        id=1,
        trace_id="t",
        sequence=1,
        content="",
        thinking="",
        model="",
        input_tokens=0,
        output_tokens=0,
        **values,
    )
    row.created_at = UPDATED
    assert getattr(common.message_pb(row), field) == number


def test_task_pb():
    row = A2ATaskRow(
        id="task-1",
        trace_id="callee-1",
        trace=TraceRow(id="callee-1", agent="coder", kind="a2a"),
        user_id=3,
        caller_agent=AgentRow(slug="general"),
        caller_trace_id="caller-1",
        caller_context={"toolCallId": "c1", "depth": 1},
        state="input-required",
        visible_in_sidebar=1,
        created_at=CREATED,
        updated_at=UPDATED,
    )
    assert common.task_pb(row, "alice") == tp.A2ATask(
        id="task-1",
        trace_id="callee-1",
        callee_agent="coder",  # the callee trace's agent
        caller_agent="general",
        caller_trace_id="caller-1",
        caller_context=_struct({"toolCallId": "c1", "depth": 1}),
        state=tp.TASK_STATE_INPUT_REQUIRED,
        visible_in_sidebar=True,
        owner="alice",
        create_time=_stamp(CREATED, 123_456_000),
        update_time=_stamp(UPDATED),
    )
    row.caller_agent, row.caller_trace_id, row.caller_context, row.state = None, None, None, "submitted"
    pb = common.task_pb(row, "alice")
    assert (pb.caller_agent, pb.caller_trace_id, pb.state) == ("", "", tp.TASK_STATE_SUBMITTED)
    assert not pb.HasField("caller_context")


def test_subagent_pb_every_field():
    row = SubagentRow(
        id=12,  # the internal key: never shown
        public_id="9f86d081884c7d659a2feaa0",
        trace_id="t-1",
        parent_message_id=41,
        parent_tool_call_id="call-7",
        parent_agent=AgentRow(slug="general"),
        source_type="preset",
        preset_agent=AgentRow(slug="coder"),
        name="part 1",
        goal="write it",
        context="facts",
        status="completed",
        model="mock-gpt",
        tool_names=["search", "fetch"],
        summary="done",
        result_payload={"answer": 42, "items": ["a"]},
        error=None,
        token_usage={"input_tokens": 3, "output_tokens": 4},
        sort_order=2,
        started_at=STARTED,
        ended_at=ENDED,
        created_at=CREATED,
        updated_at=UPDATED,
        child_trace_id="child-1",
        batch_title="research",
        background=True,
    )
    pb = common.subagent_pb(row)
    assert pb.id == "9f86d081884c7d659a2feaa0"
    assert pb.trace_id == "t-1"
    assert pb.parent_message_id == 41
    assert pb.parent_tool_call_id == "call-7"
    assert pb.parent_agent == "general"
    assert pb.source_type == ev.SUBAGENT_SOURCE_PRESET
    assert pb.preset_agent == "coder"
    assert pb.name == "part 1"
    assert pb.goal == "write it"
    assert pb.context == "facts"
    assert pb.status == ev.SUBAGENT_STATUS_COMPLETED
    assert pb.model == "mock-gpt"
    assert list(pb.tool_names) == ["search", "fetch"]
    assert pb.summary == "done"
    assert pb.result_payload == _struct({"answer": 42, "items": ["a"]})
    assert pb.error == ""
    assert pb.token_usage == ev.Usage(input_tokens=3, output_tokens=4)
    assert pb.sort_order == 2
    assert pb.start_time == _stamp(datetime(2026, 11, 30, 13, 0, 1))
    assert pb.end_time == _stamp(datetime(2026, 11, 30, 13, 30, 0), 5_000)
    assert pb.create_time == _stamp(CREATED, 123_456_000)
    assert pb.update_time == _stamp(UPDATED)
    assert pb.child_trace_id == "child-1"
    assert pb.batch_title == "research"
    assert pb.background is True
    # Every field of the message was checked above.
    assert {f.name for f, _ in pb.ListFields()} | {"error"} == {f.name for f in pb.DESCRIPTOR.fields}


def test_subagent_pb_nulls():
    """A queued clone with nothing filled in yet: NULLs become defaults, unset times stay unset."""
    row = SubagentRow(
        id=1,
        public_id="abc",
        trace_id="t-1",
        parent_message_id=2,
        parent_tool_call_id=None,
        parent_agent=None,
        source_type="clone",
        preset_agent=None,
        name="",
        goal="g",
        context=None,
        status="queued",
        model="",
        tool_names=None,
        summary=None,
        result_payload=None,
        error="boom",
        token_usage=None,
        sort_order=0,
        started_at=None,
        ended_at=None,
        created_at=UPDATED,
        updated_at=UPDATED,
        child_trace_id=None,
        batch_title="",
    )
    pb = common.subagent_pb(row)
    assert pb == tp.SubagentSession(
        id="abc",
        trace_id="t-1",
        parent_message_id=2,
        source_type=ev.SUBAGENT_SOURCE_CLONE,
        goal="g",
        status=ev.SUBAGENT_STATUS_QUEUED,
        error="boom",
        create_time=_stamp(UPDATED),
        update_time=_stamp(UPDATED),
    )
    for field in ("result_payload", "token_usage", "start_time", "end_time"):
        assert not pb.HasField(field), field


def test_usage_round_trip():
    usage = ev.Usage(input_tokens=5, output_tokens=6)
    assert common.usage_json(usage) == {"input_tokens": 5, "output_tokens": 6}
    assert common.usage_pb(common.usage_json(usage)) == usage
    assert common.usage_pb(None) is None
    assert common.usage_pb({}) == ev.Usage()


def test_structs():
    assert common.to_struct(None) is None
    assert common.to_struct({}) == struct_pb2.Struct()
    message = tp.Message(metadata=_struct({"a": [1, "x"], "b": {"c": None}}))
    assert common.from_struct(message, "metadata") == {"a": [1, "x"], "b": {"c": None}}
    assert common.from_struct(tp.Message(), "metadata") is None


def test_enum_names():
    assert common.name_of(common.KIND, tp.TRACE_KIND_A2A, "kind") == "a2a"
    assert common.name_of(common.TASK_STATE, tp.TASK_STATE_INPUT_REQUIRED, "state") == "input-required"
    assert common.number_of(common.SUB_STATUS, "cancelled") == ev.SUBAGENT_STATUS_CANCELLED
    for number in (0, 999):
        with pytest.raises(InvalidArgument, match=r"^state is required$"):
            common.name_of(common.TASK_STATE, number, "state")
    with pytest.raises(KeyError):
        common.number_of(common.KIND, "nonsense")
    with pytest.raises(KeyError):
        common.number_of(common.KIND, "unspecified")


def test_chunks():
    assert list(common.chunks([])) == []
    assert [len(c) for c in common.chunks(range(common.CHUNK * 2 + 1))] == [common.CHUNK, common.CHUNK, 1]
