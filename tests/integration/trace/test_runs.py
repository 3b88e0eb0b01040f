"""TraceService.ListRuns: the caller's runs across traces (chat turns, agent-invoke callees, subagents,
A2A tasks served to clients), with what started each, its state, tokens and times; filters and pages;
another user's runs never appear. On SQLite and PostgreSQL, over gRPC."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf import field_mask_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events, identity
from agentmesh.libs.turns import turn_messages
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import TraceStubs, append, code_of, new_trace, recent

A = tp.MESSAGE_ROLE_ASSISTANT


async def runs(stubs: TraceStubs, owner: str, **kw: Any) -> ts.ListRunsResponse:
    with identity.acting_as(owner):
        return await stubs.traces.ListRuns(ts.ListRunsRequest(**kw))


async def settle(stubs: TraceStubs, owner: str, message_id: int, status: int, **kw: Any) -> tp.Message:
    paths = ["status", *kw]
    with identity.acting_as(owner):
        request = ms.UpdateMessageRequest(
            message=tp.Message(id=message_id, status=status, **kw),  # type: ignore[arg-type]
            update_mask=field_mask_pb2.FieldMask(paths=paths),
        )
        return (await stubs.messages.UpdateMessage(request)).message


async def four_runs(stubs: TraceStubs, owner: str) -> dict[str, Any]:
    """A chat turn that runs; a callee of it that completed (with tokens); a subagent of it, queued; an
    A2A task served to a client, interrupted. Started in that order."""
    chat = await new_trace(stubs.traces, owner, title="plan a trip")
    await append(stubs.messages, owner, chat.id, "hi")
    turn = await append(stubs.messages, owner, chat.id, "", role=A, status=tp.MESSAGE_STATUS_PENDING)
    with identity.acting_as(owner):
        context = events.struct({"toolCallId": "call-1", "depth": 1, "anchorMessageId": turn.id})
        task = (
            await stubs.tasks.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(
                        callee_agent="coder", caller_agent="general", caller_trace_id=chat.id,
                        caller_context=context,
                    )
                )
            )
        ).task  # fmt: skip
    provenance = {"source": tp.MESSAGE_SOURCE_A2A, "a2a_task_id": task.id, "caller_trace_id": chat.id}
    callee = await append(
        stubs.messages, owner, task.trace_id, "", role=A, status=tp.MESSAGE_STATUS_PENDING,
        caller_agent="general", **provenance,
    )  # fmt: skip
    await settle(
        stubs, owner, callee.id, tp.MESSAGE_STATUS_COMPLETED,
        usage=ev.Usage(input_tokens=12, output_tokens=34),
    )  # fmt: skip
    user, placeholder = turn_messages(
        "", "research", source=tp.MESSAGE_SOURCE_SUBAGENT, caller_agent="general", caller_trace_id=chat.id
    )
    with identity.acting_as(owner):
        sub = (
            await stubs.subagents.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(
                    subagents=[
                        tp.SubagentSession(
                            trace_id=chat.id, parent_message_id=turn.id, name="Scout", goal="research",
                            source_type=ev.SUBAGENT_SOURCE_PRESET, preset_agent="researcher",
                        )
                    ],
                    turns=[ms.TurnMessages(user_message=user, assistant_message=placeholder)],
                )
            )
        )  # fmt: skip
    with identity.acting_as(owner):
        served = (
            await stubs.tasks.CreateA2ATask(tks.CreateA2ATaskRequest(task=tp.A2ATask(callee_agent="coder")))
        ).task
    remote = await append(
        stubs.messages, owner, served.trace_id, "", role=A, status=tp.MESSAGE_STATUS_PENDING,
        source=tp.MESSAGE_SOURCE_A2A, a2a_task_id=served.id,
    )  # fmt: skip
    interrupted = {"error": {"code": "interrupted", "message": "the process running this work stopped"}}
    await settle(stubs, owner, remote.id, tp.MESSAGE_STATUS_FAILED, metadata=events.struct(interrupted))
    return {
        "chat": chat,
        "turn": turn,
        "task": task,
        "callee": callee,
        "subagent": sub.subagents[0],
        "sub_turn": sub.turns[0].assistant_message,
        "served": served,
        "remote": remote,
    }


async def test_runs_of_every_kind_with_what_started_them(stubs, unique):
    owner = f"runs-{unique}"
    made = await four_runs(stubs, owner)
    listed = (await runs(stubs, owner)).runs
    assert [r.message_id for r in listed] == [
        made["remote"].id,
        made["sub_turn"].id,
        made["callee"].id,
        made["turn"].id,
    ]  # newest first
    remote, sub, callee, turn = listed

    assert (turn.kind, turn.state, turn.trace_id) == (tp.RUN_KIND_CHAT, tp.RUN_STATE_RUNNING, made["chat"].id)
    assert (turn.agent, turn.title, turn.parent_trace_id) == ("general", "plan a trip", "")
    assert recent(turn.start_time) and not turn.HasField("end_time")

    assert (callee.kind, callee.state, callee.agent) == (tp.RUN_KIND_CALLEE, tp.RUN_STATE_DONE, "coder")
    assert (callee.parent_trace_id, callee.parent_message_id) == (made["chat"].id, made["turn"].id)
    assert (callee.task_id, callee.caller_agent, callee.trace_id) == (
        made["task"].id,
        "general",
        made["task"].trace_id,
    )
    assert (callee.usage.input_tokens, callee.usage.output_tokens) == (12, 34)
    assert recent(callee.end_time) and callee.end_time.ToNanoseconds() >= callee.start_time.ToNanoseconds()

    assert (sub.kind, sub.state, sub.title) == (tp.RUN_KIND_SUBAGENT, tp.RUN_STATE_RUNNING, "Scout")
    assert (sub.subagent_id, sub.trace_id) == (made["subagent"].id, made["subagent"].child_trace_id)
    assert (sub.parent_trace_id, sub.parent_message_id) == (made["chat"].id, made["turn"].id)

    assert (remote.kind, remote.state, remote.task_id) == (
        tp.RUN_KIND_A2A,
        tp.RUN_STATE_INTERRUPTED,
        made["served"].id,
    )
    assert remote.parent_trace_id == "" and "stopped" in remote.error and recent(remote.end_time)


async def test_filters_and_pages(stubs, unique):
    owner = f"runs-{unique}"
    made = await four_runs(stubs, owner)
    running = (await runs(stubs, owner, state=tp.RUN_STATE_RUNNING)).runs
    assert [r.message_id for r in running] == [made["sub_turn"].id, made["turn"].id]
    assert [r.message_id for r in (await runs(stubs, owner, state=tp.RUN_STATE_DONE)).runs] == [
        made["callee"].id
    ]
    assert [r.message_id for r in (await runs(stubs, owner, state=tp.RUN_STATE_INTERRUPTED)).runs] == [
        made["remote"].id
    ]
    assert (await runs(stubs, owner, state=tp.RUN_STATE_FAILED)).runs == []  # interrupted is its own
    for kind, key in (
        (tp.RUN_KIND_CHAT, "turn"), (tp.RUN_KIND_CALLEE, "callee"),
        (tp.RUN_KIND_SUBAGENT, "sub_turn"), (tp.RUN_KIND_A2A, "remote"),
    ):  # fmt: skip
        assert [r.message_id for r in (await runs(stubs, owner, kind=kind)).runs] == [made[key].id]
    by_coder = (await runs(stubs, owner, agent="coder")).runs
    assert [r.message_id for r in by_coder] == [made["remote"].id, made["callee"].id]
    assert (await runs(stubs, owner, agent="coder", state=tp.RUN_STATE_RUNNING)).runs == []

    seen: list[int] = []
    token = ""
    for _ in range(5):
        page = await runs(stubs, owner, page_size=1, page_token=token)
        seen += [r.message_id for r in page.runs]
        token = page.next_page_token
        if not token:
            break
    assert seen == [r.message_id for r in (await runs(stubs, owner)).runs] and len(seen) == 4


async def test_another_users_runs_never_appear(stubs, unique):
    owner, other = f"runs-{unique}", f"other-{unique}"
    await four_runs(stubs, owner)
    assert (await runs(stubs, other)).runs == []
    mine = await new_trace(stubs.traces, other)
    await append(stubs.messages, other, mine.id, "", role=A, status=tp.MESSAGE_STATUS_PENDING)
    assert [r.trace_id for r in (await runs(stubs, other)).runs] == [mine.id]
    assert mine.id not in {r.trace_id for r in (await runs(stubs, owner)).runs}


async def test_a_deleted_trace_takes_its_runs(stubs, unique):
    owner = f"runs-{unique}"
    made = await four_runs(stubs, owner)
    with identity.acting_as(owner):
        await stubs.traces.DeleteTrace(ts.DeleteTraceRequest(trace_id=made["chat"].id))
    assert [r.message_id for r in (await runs(stubs, owner)).runs] == [made["remote"].id]


@pytest.mark.parametrize(
    "request_",
    [
        ts.ListRunsRequest(state=99),  # type: ignore[arg-type]
        ts.ListRunsRequest(kind=99),  # type: ignore[arg-type]
        ts.ListRunsRequest(agent="x" * 101),
        ts.ListRunsRequest(agent="a\x00b"),
        ts.ListRunsRequest(page_size=-1),
        ts.ListRunsRequest(page_token="not-a-token"),
    ],
)
async def test_bad_requests_are_invalid_arguments(stubs, unique, request_):
    with identity.acting_as(f"runs-{unique}"):
        assert await code_of(stubs.traces.ListRuns(request_)) == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_token_of_the_trace_list_is_refused(stubs, unique):
    owner = f"runs-{unique}"
    for _ in range(2):
        await new_trace(stubs.traces, owner)
    with identity.acting_as(owner):
        token = (await stubs.traces.ListTraces(ts.ListTracesRequest(page_size=1))).next_page_token
        assert token
        request = ts.ListRunsRequest(page_token=token)
        assert await code_of(stubs.traces.ListRuns(request)) == grpc.StatusCode.INVALID_ARGUMENT
