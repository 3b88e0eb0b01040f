"""services/trace/handlers/subagents.py: how a batch's rows begin, the fields a change sets and the
status moves with the times they stamp (the change itself, then through a SQLite store)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import FailedPrecondition, InvalidArgument
from agentmesh.services.trace import domain
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.subagents import SubagentHandler, change_of
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.unit.trace.handlers.conftest import assistant, user

Q, R, C, F, X = (
    ev.SUBAGENT_STATUS_QUEUED,
    ev.SUBAGENT_STATUS_RUNNING,
    ev.SUBAGENT_STATUS_COMPLETED,
    ev.SUBAGENT_STATUS_FAILED,
    ev.SUBAGENT_STATUS_CANCELLED,
)
T1, T2 = datetime(2026, 1, 1, tzinfo=UTC), datetime(2026, 1, 2, tzinfo=UTC)


def _moved(status: int, to: int, at: datetime = T1) -> tp.SubagentSession:
    current = tp.SubagentSession(id="s", status=status)  # type: ignore[arg-type]
    return change_of(tp.SubagentSession(status=to), {"status"})(current, at)  # type: ignore[arg-type]


@pytest.mark.parametrize("old", [Q, R, C, F, X])
@pytest.mark.parametrize("new", [Q, R, C, F, X])
def test_a_status_moves_only_forward(old: int, new: int) -> None:
    if new == old or new in domain.SUBAGENT_MOVES[old]:
        assert _moved(old, new).status == new
    else:
        with pytest.raises(FailedPrecondition, match=r"^subagent cannot go from \w+ to \w+$"):
            _moved(old, new)


def test_moves_stamp_the_start_and_the_end_once() -> None:
    running = _moved(Q, R, T1)
    assert (running.start_time.ToDatetime(UTC), running.HasField("end_time")) == (T1, False)
    done = change_of(tp.SubagentSession(status=C), {"status"})(running, T2)
    assert (done.start_time.ToDatetime(UTC), done.end_time.ToDatetime(UTC)) == (T1, T2)
    failed_early = _moved(Q, F, T2)
    assert (failed_early.HasField("start_time"), failed_early.end_time.ToDatetime(UTC)) == (False, T2)


def test_a_change_sets_only_the_fields_of_its_mask() -> None:
    current = tp.SubagentSession(id="s", status=R, model="m1", summary="old", error="e", tool_names=["a"])
    current.result_payload.update({"k": 1})
    update = tp.SubagentSession(status=C, model="m2", summary="new", tool_names=["b", "c"])
    new = change_of(update, {"summary", "tool_names", "result_payload", "error"})(current, T1)
    assert (new.status, new.model, new.summary, list(new.tool_names)) == (R, "m1", "new", ["b", "c"])
    assert not new.HasField("result_payload") and new.error == ""  # cleared: in the mask, unset
    assert current.summary == "old"  # the row given is not changed


async def _anchor(traces: TraceHandler, messages: MessageHandler, owner: str) -> tuple[str, int]:
    trace = await traces.create(owner, tp.Trace(agent="general"))
    _, anchor = await messages.append_finished(owner, trace.id, [user("split"), assistant("")])
    return trace.id, anchor.id


async def test_rows_begin_queued_or_failed_with_their_source(
    traces: TraceHandler, messages: MessageHandler, subagents: SubagentHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace_id, anchor = await _anchor(traces, messages, owner)

    def row(**kw: object) -> tp.SubagentSession:
        return tp.SubagentSession(trace_id=trace_id, parent_message_id=anchor, name="n", goal="g", **kw)  # type: ignore[arg-type]

    assert await subagents.create(owner, []) == ([], [])
    with pytest.raises(InvalidArgument, match=r"^a subagent starts queued \(or failed, with its error\)$"):
        await subagents.create(owner, [row(status=R)])
    with pytest.raises(InvalidArgument, match=r"^give one turn per subagent, or none$"):
        await subagents.create(owner, [row(), row()], [(user("x"), assistant())])
    with pytest.raises(InvalidArgument, match=r"^trace_id is required$"):
        await subagents.create(owner, [tp.SubagentSession(parent_message_id=anchor)])
    (clone, preset, failed), _ = await subagents.create(
        owner, [row(), row(preset_agent="coder"), row(status=F, error="no")]
    )
    assert (clone.source_type, clone.status) == (ev.SUBAGENT_SOURCE_CLONE, Q)
    assert (preset.source_type, preset.preset_agent) == (ev.SUBAGENT_SOURCE_PRESET, "coder")
    assert (failed.status, failed.error, failed.HasField("end_time")) == (F, "no", True)


async def test_updates_check_every_mask_and_move_all_or_none(
    traces: TraceHandler, messages: MessageHandler, subagents: SubagentHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace_id, anchor = await _anchor(traces, messages, owner)
    rows, _ = await subagents.create(
        owner,
        [tp.SubagentSession(trace_id=trace_id, parent_message_id=anchor, name=f"s{i}") for i in range(2)],
    )
    a, b = rows
    with pytest.raises(InvalidArgument, match=r"^cannot update name$"):
        await subagents.update(owner, tp.SubagentSession(id=a.id, name="x"), ["name"])
    with pytest.raises(InvalidArgument, match=r"^status is required$"):
        await subagents.update(owner, tp.SubagentSession(id=a.id), ["status"])
    too_many = [(tp.SubagentSession(id=a.id), ["model"])] * (domain.MAX_SUBAGENT_UPDATES + 1)
    with pytest.raises(InvalidArgument, match=r"^at most 100 subagent changes per call$"):
        await subagents.update_many(owner, too_many)
    # b cannot complete from queued: a's move to running is not written either.
    with pytest.raises(FailedPrecondition, match=r"^subagent cannot go from queued to completed$"):
        await subagents.update_many(
            owner,
            [
                (tp.SubagentSession(id=a.id, status=R), ["status"]),
                (tp.SubagentSession(id=b.id, status=C), ["status"]),
            ],
        )
    assert (await subagents.get(owner, a.id)).status == Q
    # A later change of one call sees the earlier one: queued -> running -> completed.
    ran, done = await subagents.update_many(
        owner,
        [
            (tp.SubagentSession(id=a.id, status=R), ["status"]),
            (tp.SubagentSession(id=a.id, status=C), ["status"]),
        ],
    )
    assert (ran.status, done.status, done.HasField("start_time"), done.HasField("end_time")) == (
        R,
        C,
        True,
        True,
    )
    assert [r.status for r in await subagents.list(owner, trace_id)] == [C, Q]
