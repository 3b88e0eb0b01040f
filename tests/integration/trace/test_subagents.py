"""Subagent rows (docs/requirements.md#subagent-rows): batches, hidden child traces, order, status moves,
output-only times."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace
from typing import Any

import grpc
from google.protobuf import field_mask_pb2, struct_pb2, timestamp_pb2

from agentmesh.agents.v1 import agent_pb2 as ap
from agentmesh.agents.v1 import agent_service_pb2 as ag
from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.libs.errors import FailedPrecondition
from agentmesh.services.orchestrator.subagents import RowWriter
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import append, code_of, error_of, new_trace, recent

BAD = grpc.StatusCode.INVALID_ARGUMENT
FAILED = grpc.StatusCode.FAILED_PRECONDITION
ASSISTANT = tp.MESSAGE_ROLE_ASSISTANT


async def _create(stub, owner, *subs):
    with identity.acting_as(owner):
        resp = await stub.CreateSubagentSessions(sbs.CreateSubagentSessionsRequest(subagents=list(subs)))
    return list(resp.subagents)


async def test_subagent_rows_and_transitions(trace_stub, unique, subagent_stub, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(message_stub, owner, s.id, "split this")
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    other_anchor = await append(message_stub, owner, s.id, "", ASSISTANT)

    def sub(name: str, order: int, anchor_id: int = anchor.id, **kw: Any) -> tp.SubagentSession:
        return tp.SubagentSession(
            trace_id=s.id, parent_message_id=anchor_id, name=name, goal=f"do {name}", sort_order=order, **kw
        )

    # One batch, answered in request order.
    b, a = await _create(
        subagent_stub,
        owner,
        sub("b", 1, preset_agent="researcher", tool_names=["search"], batch_title="research"),
        sub("a", 0, parent_tool_call_id="call-7", context="facts"),
    )
    (z,) = await _create(subagent_stub, owner, sub("z", 0, anchor_id=other_anchor.id))
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

        one = await subagent_stub.ListSubagentSessions(
            sbs.ListSubagentSessionsRequest(trace_id=s.id, parent_message_id=anchor.id)
        )
        assert [r.name for r in one.subagents] == ["a", "b"]
        every = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
        assert [r.name for r in every.subagents] == ["a", "b", "z"]
        assert list(every.subagents) == [a, b, z]
        got = await subagent_stub.GetSubagentSession(sbs.GetSubagentSessionRequest(subagent_id=b.id))
        assert got.subagent == b

    def update(row: Any, status: Any = 0, paths: Any = ("status",), **kw: Any) -> Any:
        change = tp.SubagentSession(id=row.id, status=status, **kw)
        mask = field_mask_pb2.FieldMask(paths=list(paths))
        with identity.acting_as(owner):
            return subagent_stub.UpdateSubagentSession(
                sbs.UpdateSubagentSessionRequest(subagent=change, update_mask=mask)
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
            await subagent_stub.GetSubagentSession(sbs.GetSubagentSessionRequest(subagent_id=b.id))
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


async def test_subagent_batch_rules(trace_stub, unique, subagent_stub, message_stub):
    """A batch is checked whole and created in one transaction; a row starts queued or failed."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    other = await new_trace(trace_stub, owner)
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    foreign_anchor = await append(message_stub, owner, other.id, "", ASSISTANT)
    good = tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name="ok", goal="fine")

    assert await _create(subagent_stub, owner) == []
    (refused,) = await _create(
        subagent_stub,
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
            request = sbs.CreateSubagentSessionsRequest(subagents=[good, row])
            assert await code_of(subagent_stub.CreateSubagentSessions(request)) == BAD, what
        # A clone of nobody: the trace names no agent and the row no preset or parent agent.
        agentless = await new_trace(trace_stub, owner, agent="")
        agentless_anchor = await append(message_stub, owner, agentless.id, "", ASSISTANT)
        clone = tp.SubagentSession(trace_id=agentless.id, parent_message_id=agentless_anchor.id, name="c")
        error = await error_of(
            subagent_stub.CreateSubagentSessions(sbs.CreateSubagentSessionsRequest(subagents=[clone]))
        )
        assert (error.code(), error.details()) == (
            BAD,
            "a subagent needs an agent: preset_agent or parent_agent",
        )
        # Nothing of the refused batches was stored: only the failed row above exists.
        listed = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
        assert [r.id for r in listed.subagents] == [refused.id]
        listed_other = await subagent_stub.ListSubagentSessions(
            sbs.ListSubagentSessionsRequest(trace_id=other.id)
        )
        assert list(listed_other.subagents) == []


async def test_several_rows_change_in_one_call_all_or_none(trace_stub, unique, subagent_stub, message_stub):
    """UpdateSubagentSessions: each change as UpdateSubagentSession would make it, answered in request
    order; one change that cannot be made (a backward move, a row not found) leaves every row as it was."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    rows = await _create(
        subagent_stub,
        owner,
        *(
            tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name=n, sort_order=i)
            for i, n in enumerate("abc")
        ),
    )
    a, b, c = rows

    def change(
        row: Any, status: Any, paths: Any = ("status",), **kw: Any
    ) -> sbs.UpdateSubagentSessionRequest:
        return sbs.UpdateSubagentSessionRequest(
            subagent=tp.SubagentSession(id=row.id, status=status, **kw),
            update_mask=field_mask_pb2.FieldMask(paths=list(paths)),
        )

    async def update(*changes: sbs.UpdateSubagentSessionRequest) -> Any:
        with identity.acting_as(owner):
            return await subagent_stub.UpdateSubagentSessions(
                sbs.UpdateSubagentSessionsRequest(updates=changes)
            )

    async def stored() -> list[tp.SubagentSession]:
        with identity.acting_as(owner):
            resp = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
        return list(resp.subagents)

    started = (
        await update(change(c, ev.SUBAGENT_STATUS_RUNNING), change(a, ev.SUBAGENT_STATUS_RUNNING))
    ).subagents
    assert [r.id for r in started] == [c.id, a.id]  # request order
    assert all(r.status == ev.SUBAGENT_STATUS_RUNNING and recent(r.start_time) for r in started)
    before = await stored()
    assert [r.status for r in before] == [
        ev.SUBAGENT_STATUS_RUNNING,
        ev.SUBAGENT_STATUS_QUEUED,
        ev.SUBAGENT_STATUS_RUNNING,
    ]

    # A backward move (c: running -> queued) refuses the whole call: a and b stay as they were.
    error = await error_of(
        update(
            change(a, ev.SUBAGENT_STATUS_COMPLETED, ("status", "summary"), summary="done"),
            change(b, ev.SUBAGENT_STATUS_CANCELLED),
            change(c, ev.SUBAGENT_STATUS_QUEUED),
        )
    )
    assert (error.code(), error.details()) == (FAILED, "subagent cannot go from running to queued")
    assert await stored() == before
    # So does a row that is not found, or another owner's (the same answer), and a bad mask.
    missing = tp.SubagentSession(id="0" * 24)
    for bad, code in (
        (change(missing, ev.SUBAGENT_STATUS_CANCELLED), grpc.StatusCode.NOT_FOUND),
        (change(b, ev.SUBAGENT_STATUS_CANCELLED, ("name",)), BAD),
    ):
        assert await code_of(update(change(a, ev.SUBAGENT_STATUS_FAILED), bad)) == code
    with identity.acting_as(f"stranger-{unique}"):
        error = await error_of(
            subagent_stub.UpdateSubagentSessions(
                sbs.UpdateSubagentSessionsRequest(updates=[change(b, ev.SUBAGENT_STATUS_CANCELLED)])
            )
        )
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "subagent session not found")
    assert await stored() == before
    # More than 100 changes in one call are refused as a whole.
    too_many = [change(b, ev.SUBAGENT_STATUS_CANCELLED)] * 101
    error = await error_of(update(*too_many))
    assert (error.code(), error.details()) == (BAD, "at most 100 subagent changes per call")
    assert await stored() == before

    ended = (
        await update(
            change(a, ev.SUBAGENT_STATUS_COMPLETED, ("status", "summary"), summary="done"),
            change(b, ev.SUBAGENT_STATUS_CANCELLED),
            change(c, ev.SUBAGENT_STATUS_FAILED, ("status", "error"), error="boom"),
        )
    ).subagents
    assert [(r.status, r.summary, r.error) for r in ended] == [
        (ev.SUBAGENT_STATUS_COMPLETED, "done", ""),
        (ev.SUBAGENT_STATUS_CANCELLED, "", ""),
        (ev.SUBAGENT_STATUS_FAILED, "", "boom"),
    ]
    assert all(recent(r.end_time) for r in ended) and await stored() == list(ended)


async def test_the_runtimes_row_writer_coalesces_and_keeps_failures_apart(
    trace_clients, unique, subagent_stub, message_stub
):
    """services/orchestrator/subagents.RowWriter: changes asked for while a call is in flight go in
    the next as one UpdateSubagentSessions; when that call is refused, each change is retried on its
    own, so only the change that cannot be made fails."""
    owner = f"u-{unique}"
    trace_stub = trace_clients.trace
    s = await new_trace(trace_stub, owner)
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    a, b, c, d = await _create(
        subagent_stub,
        owner,
        *(
            tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name=n, sort_order=i)
            for i, n in enumerate("abcd")
        ),
    )
    calls: list[tuple[str, int]] = []

    class Counted:
        """The real stub, noting each call (method, rows)."""

        def __getattr__(self, name: str) -> Any:
            method = getattr(subagent_stub, name)

            def call(request: Any, **kw: Any) -> Any:
                calls.append((name, len(request.updates) if hasattr(request, "updates") else 1))
                return method(request, **kw)

            return call

    writer = RowWriter(SimpleNamespace(subagents=Counted()))  # type: ignore[arg-type]

    def change(row: Any, status: Any) -> sbs.UpdateSubagentSessionRequest:
        return sbs.UpdateSubagentSessionRequest(
            subagent=tp.SubagentSession(id=row.id, status=status),
            update_mask=field_mask_pb2.FieldMask(paths=["status"]),
        )

    async def together(*changes: sbs.UpdateSubagentSessionRequest) -> list[Any]:
        with identity.acting_as(owner):
            return await asyncio.gather(*(writer.update(c) for c in changes), return_exceptions=True)

    running = await together(*(change(r, ev.SUBAGENT_STATUS_RUNNING) for r in (a, b, c, d)))
    assert [r.status for r in running] == [ev.SUBAGENT_STATUS_RUNNING] * 4
    assert calls == [("UpdateSubagentSessions", 4)]  # asked for together: written together

    calls.clear()
    # b cannot go back to queued: the coalesced call is refused, and each of its changes retried alone.
    first, done, back, cancelled = await together(
        change(a, ev.SUBAGENT_STATUS_COMPLETED),
        change(c, ev.SUBAGENT_STATUS_COMPLETED),
        change(b, ev.SUBAGENT_STATUS_QUEUED),
        change(d, ev.SUBAGENT_STATUS_CANCELLED),
    )
    assert (first.status, done.status, cancelled.status) == (
        ev.SUBAGENT_STATUS_COMPLETED,
        ev.SUBAGENT_STATUS_COMPLETED,
        ev.SUBAGENT_STATUS_CANCELLED,
    )
    assert (
        isinstance(back, FailedPrecondition) and back.message == "subagent cannot go from running to queued"
    )
    assert calls == [("UpdateSubagentSessions", 4)] + [("UpdateSubagentSession", 1)] * 4
    with identity.acting_as(owner):
        stored = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
    assert [r.status for r in stored.subagents] == [
        ev.SUBAGENT_STATUS_COMPLETED,
        ev.SUBAGENT_STATUS_RUNNING,
        ev.SUBAGENT_STATUS_COMPLETED,
        ev.SUBAGENT_STATUS_CANCELLED,
    ]


async def test_a_batch_stores_each_subagents_turn_with_its_row(
    trace_stub, unique, message_stub, subagent_stub
):
    """CreateSubagentSessions with turns: each hidden trace begins with its turn's user message and
    placeholder, stored in the same transaction (sequences 1 and 2, the head at the placeholder, the
    provenance kept); a count of turns other than one per row is refused and nothing is stored."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(message_stub, owner, s.id, "split this")
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    rows = [
        tp.SubagentSession(
            trace_id=s.id,
            parent_message_id=anchor.id,
            parent_agent="general",
            name=f"n{i}",
            goal=f"g{i}",
            sort_order=i,
        )
        for i in range(2)
    ]

    def turn(i: int) -> ms.TurnMessages:
        def message(role: tp.MessageRole, text: str, status: tp.MessageStatus) -> tp.Message:
            return tp.Message(
                role=role, content=text, status=status, source=tp.MESSAGE_SOURCE_SUBAGENT,
                caller_agent="general", caller_trace_id=s.id, model="mock-gpt" if text == "" else "",
            )  # fmt: skip

        return ms.TurnMessages(
            user_message=message(tp.MESSAGE_ROLE_USER, f"g{i}", tp.MESSAGE_STATUS_COMPLETED),
            assistant_message=message(ASSISTANT, "", tp.MESSAGE_STATUS_PENDING),
        )

    with identity.acting_as(owner):
        refused = sbs.CreateSubagentSessionsRequest(subagents=rows, turns=[turn(0)])
        assert await code_of(subagent_stub.CreateSubagentSessions(refused)) == BAD
        listed = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
        assert list(listed.subagents) == []
        resp = await subagent_stub.CreateSubagentSessions(
            sbs.CreateSubagentSessionsRequest(subagents=rows, turns=[turn(0), turn(1)])
        )
        assert len(resp.turns) == 2
        for i, (row, begun) in enumerate(zip(resp.subagents, resp.turns, strict=True)):
            user, placeholder = begun.user_message, begun.assistant_message
            assert (user.trace_id, user.sequence, user.content, user.caller_agent) == (
                row.child_trace_id, 1, f"g{i}", "general"
            )  # fmt: skip
            assert (placeholder.sequence, placeholder.parent_sequence, placeholder.status) == (
                2, 1, tp.MESSAGE_STATUS_PENDING
            )  # fmt: skip
            path = await message_stub.ListMessages(
                ms.ListMessagesRequest(trace_id=row.child_trace_id, mode=ms.PATH_MODE_MAIN_PATH)
            )
            assert list(path.messages) == [user, placeholder] and path.head_sequence == 2
            following = await append(message_stub, owner, row.child_trace_id, "next")
            assert (following.sequence, following.parent_sequence) == (3, 2)


async def test_a_row_changed_twice_in_one_call_and_an_own_agent_before_the_builtin(
    trace_stub, agent_stub, unique, subagent_stub, message_stub
):
    """UpdateSubagentSessions may change one row twice (the runtime's row writer sends a row's start
    and end together when both wait for the call in flight): each change is answered as made, in
    order, and the row ends as the last answer says. A row's preset agent is the caller's own agent of
    that slug when there is one (not the built-in it hides): deleting it clears the row's link."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    anchor = await append(message_stub, owner, s.id, "", ASSISTANT)
    with identity.acting_as(owner):
        own = ap.Agent(slug="coder", name="My coder", model="mock-gpt")
        await agent_stub.CreateAgent(
            ag.CreateAgentRequest(
                agent=own, field_mask=field_mask_pb2.FieldMask(paths=["slug", "name", "model"])
            )
        )
    row, builtin = await _create(
        subagent_stub,
        owner,
        tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name="a", preset_agent="coder"),
        tp.SubagentSession(trace_id=s.id, parent_message_id=anchor.id, name="b", preset_agent="researcher"),
    )
    assert (row.preset_agent, builtin.preset_agent) == ("coder", "researcher")

    def change(status: Any, paths: tuple[str, ...], **kw: Any) -> sbs.UpdateSubagentSessionRequest:
        return sbs.UpdateSubagentSessionRequest(
            subagent=tp.SubagentSession(id=row.id, status=status, **kw),
            update_mask=field_mask_pb2.FieldMask(paths=list(paths)),
        )

    with identity.acting_as(owner):
        resp = await subagent_stub.UpdateSubagentSessions(
            sbs.UpdateSubagentSessionsRequest(
                updates=[
                    change(ev.SUBAGENT_STATUS_RUNNING, ("status", "model"), model="m1"),
                    change(
                        ev.SUBAGENT_STATUS_COMPLETED,
                        ("status", "summary", "token_usage"),
                        summary="done",
                        token_usage=ev.Usage(input_tokens=3, output_tokens=4),
                    ),
                ]
            )
        )
        started, ended = resp.subagents
        assert (started.status, started.model, started.summary) == (ev.SUBAGENT_STATUS_RUNNING, "m1", "")
        assert recent(started.start_time) and not started.HasField("end_time")
        assert (ended.status, ended.model, ended.summary, ended.token_usage.output_tokens) == (
            ev.SUBAGENT_STATUS_COMPLETED, "m1", "done", 4
        )  # fmt: skip
        assert ended.start_time == started.start_time and recent(ended.end_time)
        got = await subagent_stub.GetSubagentSession(sbs.GetSubagentSessionRequest(subagent_id=row.id))
        assert got.subagent == ended

        await agent_stub.DeleteAgent(ag.DeleteAgentRequest(slug="coder"))
        listed = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=s.id))
        assert [r.preset_agent for r in listed.subagents] == ["", "researcher"]
