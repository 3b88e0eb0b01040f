"""Subagent rows (seed 3 section 5): batches, hidden child traces, order, status moves, output-only times."""

from __future__ import annotations

import re
from typing import Any

import grpc
from google.protobuf import field_mask_pb2, struct_pb2, timestamp_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from libs import identity
from tests.trace.conftest import append, code_of, error_of, new_trace, recent

BAD = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION
ASSISTANT = tp.MESSAGE_ROLE_ASSISTANT


async def _create(stub, owner, *subs):
    with identity.acting_as(owner):
        resp = await stub.CreateSubagentSessions(ts.CreateSubagentSessionsRequest(subagents=list(subs)))
    return list(resp.subagents)


async def test_subagent_rows_and_transitions(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(trace_stub, owner, s.id, "split this")
    anchor = await append(trace_stub, owner, s.id, "", ASSISTANT)
    other_anchor = await append(trace_stub, owner, s.id, "", ASSISTANT)

    def sub(name: str, order: int, anchor_id: int = anchor.id, **kw: Any) -> tp.SubagentSession:
        return tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor_id, name=name, goal=f"do {name}", sort_order=order, **kw
        )

    # One batch, answered in request order.
    b, a = await _create(
        trace_stub,
        owner,
        sub("b", 1, preset_agent="researcher", tool_names=["search"], batch_title="research"),
        sub("a", 0, parent_tool_call_id="call-7", context="facts"),
    )
    (z,) = await _create(trace_stub, owner, sub("z", 0, anchor_id=other_anchor.id))
    ids = [a.id, b.id, z.id]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"[0-9a-f]{24}", i) for i in ids)  # not guessable
    assert (a.status, a.parent_agent, a.source_type, a.preset_agent, a.parent_tool_call_id) == (
        ev.SUBAGENT_STATUS_QUEUED,
        "general",
        ev.SUBAGENT_SOURCE_CLONE,
        "",
        "call-7",
    )
    assert (a.trace_id, a.parent_message_id, a.name, a.goal, a.context, a.sort_order) == (
        s.id,
        anchor.id,
        "a",
        "do a",
        "facts",
        0,
    )
    assert (b.preset_agent, b.source_type, list(b.tool_names), b.batch_title) == (
        "researcher",
        ev.SUBAGENT_SOURCE_PRESET,
        ["search"],
        "research",
    )
    # Start and end times are output only: a queued row has neither.
    for row in (a, b, z):
        assert not row.HasField("start_time") and not row.HasField("end_time")
        assert recent(row.create_time) and row.update_time == row.create_time
    with identity.acting_as(owner):
        child = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=b.child_trace_id))).trace
        assert (child.kind, child.agent, child.title, child.owner) == (
            tp.TRACE_KIND_SUBAGENT,
            "researcher",
            "b",
            owner,
        )
        clone = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=a.child_trace_id))).trace
        assert (clone.kind, clone.agent) == (tp.TRACE_KIND_SUBAGENT, "general")

        one = await trace_stub.ListSubagentSessions(
            ts.ListSubagentSessionsRequest(trace_id=s.id, parent_message_id=anchor.id)
        )
        assert [r.name for r in one.subagents] == ["a", "b"]
        every = await trace_stub.ListSubagentSessions(ts.ListSubagentSessionsRequest(trace_id=s.id))
        assert [r.name for r in every.subagents] == ["a", "b", "z"]
        assert list(every.subagents) == [a, b, z]
        got = await trace_stub.GetSubagentSession(ts.GetSubagentSessionRequest(subagent_id=b.id))
        assert got.subagent == b

    def update(row: Any, status: Any = 0, paths: Any = ("status",), **kw: Any) -> Any:
        change = tp.SubagentSession(id=row.id, status=status, **kw)
        mask = field_mask_pb2.FieldMask(paths=list(paths))
        with identity.acting_as(owner):
            return trace_stub.UpdateSubagentSession(
                ts.UpdateSubagentSessionRequest(subagent=change, update_mask=mask)
            )

    running = (await update(a, ev.SUBAGENT_STATUS_RUNNING)).subagent
    assert running.status == ev.SUBAGENT_STATUS_RUNNING and recent(running.start_time)
    assert not running.HasField("end_time")
    error = await error_of(update(a, ev.SUBAGENT_STATUS_QUEUED))
    assert (error.code(), error.details()) == (FAILED, "subagent cannot go from running to queued")
    payload = struct_pb2.Struct()
    payload.update({"answer": 42})
    done = (
        await update(
            a,
            ev.SUBAGENT_STATUS_COMPLETED,
            ("status", "summary", "result_payload", "token_usage", "model", "tool_names"),
            summary="all done",
            result_payload=payload,
            token_usage=ev.Usage(input_tokens=7, output_tokens=9),
            model="mock-gpt",
            tool_names=["search", "fetch"],
        )
    ).subagent
    assert (
        done.status,
        done.summary,
        done.result_payload,
        done.token_usage,
        done.model,
        list(done.tool_names),
    ) == (
        ev.SUBAGENT_STATUS_COMPLETED,
        "all done",
        payload,
        ev.Usage(input_tokens=7, output_tokens=9),
        "mock-gpt",
        ["search", "fetch"],
    )
    # The move to running set start_time, the move to a final status end_time; neither moves again.
    assert done.start_time == running.start_time
    assert recent(done.end_time) and done.end_time.ToNanoseconds() >= done.start_time.ToNanoseconds()
    for status in (ev.SUBAGENT_STATUS_RUNNING, ev.SUBAGENT_STATUS_FAILED, ev.SUBAGENT_STATUS_CANCELLED):
        assert await code_of(update(a, status)) == FAILED
    again = (
        await update(a, ev.SUBAGENT_STATUS_COMPLETED, ("status", "summary"), summary="still done")
    ).subagent
    assert (again.summary, again.start_time, again.end_time) == ("still done", done.start_time, done.end_time)
    # queued -> cancelled and queued -> failed are allowed; queued -> completed is not.
    assert await code_of(update(z, ev.SUBAGENT_STATUS_COMPLETED)) == FAILED
    cancelled = (await update(z, ev.SUBAGENT_STATUS_CANCELLED)).subagent
    assert cancelled.status == ev.SUBAGENT_STATUS_CANCELLED
    assert recent(cancelled.end_time) and not cancelled.HasField("start_time")
    failed = (await update(b, ev.SUBAGENT_STATUS_FAILED, ("status", "error"), error="boom")).subagent
    assert (failed.status, failed.error) == (ev.SUBAGENT_STATUS_FAILED, "boom")
    assert recent(failed.end_time) and not failed.HasField("start_time")
    assert await code_of(update(b, paths=())) == BAD
    assert await code_of(update(b, paths=("name",))) == BAD
    assert await code_of(update(b, paths=("status",))) == BAD  # status unset
    # Start and end times are output only: a request cannot set them.
    stamp = timestamp_pb2.Timestamp(seconds=1_700_000_000)
    for field in ("start_time", "end_time"):
        error = await error_of(update(b, paths=(field,), **{field: stamp}))
        assert (error.code(), error.details()) == (BAD, f"cannot update {field}")
    with identity.acting_as(owner):
        stored = (
            await trace_stub.GetSubagentSession(ts.GetSubagentSessionRequest(subagent_id=b.id))
        ).subagent
    assert stored == failed
    # Clearing the optional results clears them.
    cleared = (
        await update(
            a,
            ev.SUBAGENT_STATUS_COMPLETED,
            ("summary", "result_payload", "token_usage", "error"),
        )
    ).subagent
    assert (cleared.summary, cleared.error) == ("", "")
    assert not cleared.HasField("result_payload") and not cleared.HasField("token_usage")


async def test_subagent_batch_rules(trace_stub, unique):
    """A batch is checked whole and created in one transaction; a row starts queued or failed."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    other = await new_trace(trace_stub, owner)
    anchor = await append(trace_stub, owner, s.id, "", ASSISTANT)
    foreign_anchor = await append(trace_stub, owner, other.id, "", ASSISTANT)
    good = tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name="ok", goal="fine")

    assert await _create(trace_stub, owner) == []
    (refused,) = await _create(
        trace_stub,
        owner,
        tp.SubagentSession(
            trace_id=s.id,
            parent_message_id=anchor.id,
            name="no slot",
            status=ev.SUBAGENT_STATUS_FAILED,
            error="limit reached",
        ),
    )
    assert (refused.status, refused.error) == (ev.SUBAGENT_STATUS_FAILED, "limit reached")
    assert recent(refused.end_time) and not refused.HasField("start_time")

    bad_rows = {
        "missing anchor": tp.SubagentSession(trace_id=s.id, parent_message_id=999_999_999, name="x"),
        "anchor of another trace": tp.SubagentSession(
            trace_id=s.id, parent_message_id=foreign_anchor.id, name="x"
        ),
        "unknown preset": tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor.id, preset_agent="nobody"
        ),
        "unknown parent agent": tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor.id, parent_agent="nobody"
        ),
        "starts running": tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor.id, status=ev.SUBAGENT_STATUS_RUNNING
        ),
        "starts completed": tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor.id, status=ev.SUBAGENT_STATUS_COMPLETED
        ),
        "no trace": tp.SubagentSession(parent_message_id=anchor.id),
    }
    with identity.acting_as(owner):
        for what, row in bad_rows.items():
            request = ts.CreateSubagentSessionsRequest(subagents=[good, row])
            assert await code_of(trace_stub.CreateSubagentSessions(request)) == BAD, what
        # A clone of nobody: the trace names no agent and the row no preset or parent agent.
        agentless = await new_trace(trace_stub, owner, agent="")
        agentless_anchor = await append(trace_stub, owner, agentless.id, "", ASSISTANT)
        clone = tp.SubagentSession(trace_id=agentless.id, parent_message_id=agentless_anchor.id, name="c")
        error = await error_of(
            trace_stub.CreateSubagentSessions(ts.CreateSubagentSessionsRequest(subagents=[clone]))
        )
        assert (error.code(), error.details()) == (
            BAD,
            "a subagent needs an agent: preset_agent or parent_agent",
        )
        # Nothing of the refused batches was stored: only the failed row above exists.
        listed = await trace_stub.ListSubagentSessions(ts.ListSubagentSessionsRequest(trace_id=s.id))
        assert [r.id for r in listed.subagents] == [refused.id]
        listed_other = await trace_stub.ListSubagentSessions(
            ts.ListSubagentSessionsRequest(trace_id=other.id)
        )
        assert list(listed_other.subagents) == []
