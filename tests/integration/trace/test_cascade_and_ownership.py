"""Cascade deletes leave no rows behind and report what they removed; another user's ids answer exactly
like missing ones."""

from __future__ import annotations

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import TraceStubs, append, count_rows, error_of, new_trace

ASSISTANT = tp.MESSAGE_ROLE_ASSISTANT
_GONE = "NOT EXISTS (SELECT 1 FROM traces s WHERE s.id = {})"
ORPHANS = {
    "messages": "SELECT count(*) FROM messages m WHERE " + _GONE.format("m.trace_id"),
    "a2a_tasks": "SELECT count(*) FROM a2a_tasks t WHERE "
    + _GONE.format("t.trace_id")
    + " OR (t.caller_trace_id IS NOT NULL AND "
    + _GONE.format("t.caller_trace_id")
    + ")",
    "subagent_sessions": "SELECT count(*) FROM subagent_sessions r WHERE "
    + _GONE.format("r.trace_id")
    + " OR "
    + _GONE.format("r.child_trace_id")
    + " OR NOT EXISTS (SELECT 1 FROM messages m WHERE m.id = r.parent_message_id)",
}


async def _task(stub: TraceStubs, owner, caller_trace_id, callee="coder"):
    task = tp.A2ATask(callee_agent=callee, caller_agent="general", caller_trace_id=caller_trace_id)
    with identity.acting_as(owner):
        return (await stub.tasks.CreateA2ATask(tks.CreateA2ATaskRequest(task=task))).task


async def _subagent(stub: TraceStubs, owner, trace_id, anchor_id, name):
    sub = tp.SubagentSession(trace_id=trace_id, parent_message_id=anchor_id, name=name, goal=name)
    with identity.acting_as(owner):
        (row,) = (
            await stub.subagents.CreateSubagentSessions(sbs.CreateSubagentSessionsRequest(subagents=[sub]))
        ).subagents
    return row


async def _tree(stub: TraceStubs, owner):
    """A chat trace with A2A calls and subagents nested three levels deep; returns (root, every trace id
    under it, task ids, subagent ids)."""
    root = await new_trace(stub.traces, owner)
    await append(stub.messages, owner, root.id, "go")
    anchor = await append(stub.messages, owner, root.id, "", ASSISTANT)
    t1 = await _task(stub, owner, root.id)
    await append(
        stub.messages, owner, t1.trace_id, "hi coder", source=tp.MESSAGE_SOURCE_A2A, a2a_task_id=t1.id
    )
    callee_anchor = await append(stub.messages, owner, t1.trace_id, "", ASSISTANT)
    t2 = await _task(stub, owner, t1.trace_id, "researcher")  # the callee calls on
    await append(stub.messages, owner, t2.trace_id, "hi researcher", source=tp.MESSAGE_SOURCE_A2A)
    k1 = await _subagent(stub, owner, root.id, anchor.id, "k1")
    await append(stub.messages, owner, k1.child_trace_id, "sub work", source=tp.MESSAGE_SOURCE_SUBAGENT)
    t3 = await _task(stub, owner, k1.child_trace_id)  # a subagent invokes an agent
    await append(stub.messages, owner, t3.trace_id, "from the subagent")
    k2 = await _subagent(stub, owner, t1.trace_id, callee_anchor.id, "k2")  # the callee delegates
    await append(stub.messages, owner, k2.child_trace_id, "nested sub work")
    traces = {root.id, t1.trace_id, t2.trace_id, t3.trace_id, k1.child_trace_id, k2.child_trace_id}
    return root, traces, {t1.id, t2.id, t3.id}, {k1.id, k2.id}


async def _left(engine, traces, tasks, subagents):
    """Rows still present for the given ids, per table."""
    out = {}
    for table, column, ids in (
        ("traces", "id", traces),
        ("messages", "trace_id", traces),
        ("a2a_tasks", "id", tasks),
        ("a2a_tasks", "trace_id", traces),
        ("a2a_tasks", "caller_trace_id", traces),
        ("subagent_sessions", "public_id", subagents),
        ("subagent_sessions", "trace_id", traces),
        ("subagent_sessions", "child_trace_id", traces),
    ):
        params = {f"p{i}": v for i, v in enumerate(ids)}
        marks = ", ".join(f":{k}" for k in params)
        out[f"{table}.{column}"] = await count_rows(
            engine, f"SELECT count(*) FROM {table} WHERE {column} IN ({marks})", **params
        )
    return out


async def _orphans(engine):
    return {table: await count_rows(engine, sql) for table, sql in ORPHANS.items()}


async def test_delete_one_trace_cascades(trace_stub, trace_engine, unique, message_stub, stubs):
    owner = f"u-{unique}"
    root, traces, tasks, subagents = await _tree(stubs, owner)
    keep = await new_trace(trace_stub, owner)
    await append(message_stub, owner, keep.id, "stay")
    before = await _left(trace_engine, traces, tasks, subagents)
    assert before["traces.id"] == 6 and before["messages.trace_id"] == 8
    assert before["a2a_tasks.id"] == 3 and before["subagent_sessions.public_id"] == 2

    with identity.acting_as(owner):
        deleted = await trace_stub.DeleteTrace(ts.DeleteTraceRequest(trace_id=root.id))
    # It reports every id it removed, so the caller can drop their live buffers too.
    assert list(deleted.deleted_trace_ids) == sorted(traces)
    assert list(deleted.deleted_task_ids) == sorted(tasks)
    assert list(deleted.deleted_subagent_ids) == sorted(subagents)
    after = await _left(trace_engine, traces, tasks, subagents)
    assert after == dict.fromkeys(after, 0)
    assert await _orphans(trace_engine) == dict.fromkeys(ORPHANS, 0)
    with identity.acting_as(owner):
        kept = await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=keep.id, view=ts.TRACE_VIEW_FULL))
        assert kept.message_count == 1
        for trace_id in traces:
            error = await error_of(trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace_id)))
            assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "trace not found")
        again = await error_of(trace_stub.DeleteTrace(ts.DeleteTraceRequest(trace_id=root.id)))
        assert again.code() == grpc.StatusCode.NOT_FOUND


async def test_delete_all_traces_cascades(trace_stub, trace_engine, unique, stubs):
    owner, other = f"u-{unique}", f"o-{unique}"
    _, traces_a, tasks_a, subs_a = await _tree(stubs, owner)
    _, traces_b, tasks_b, subs_b = await _tree(stubs, owner)
    plain = await new_trace(trace_stub, owner)
    _, other_traces, other_tasks, other_subs = await _tree(stubs, other)

    with identity.acting_as(owner):
        resp = await trace_stub.DeleteTraces(ts.DeleteTracesRequest())
    assert list(resp.deleted_trace_ids) == sorted(traces_a | traces_b | {plain.id})  # 13
    assert list(resp.deleted_task_ids) == sorted(tasks_a | tasks_b)
    assert list(resp.deleted_subagent_ids) == sorted(subs_a | subs_b)
    after = await _left(trace_engine, traces_a | traces_b | {plain.id}, tasks_a | tasks_b, subs_a | subs_b)
    assert after == dict.fromkeys(after, 0)
    owned = "SELECT count(*) FROM traces s JOIN users u ON u.id = s.user_id WHERE u.name = :u"
    assert await count_rows(trace_engine, owned, u=owner) == 0
    assert await _orphans(trace_engine) == dict.fromkeys(ORPHANS, 0)
    untouched = await _left(trace_engine, other_traces, other_tasks, other_subs)
    assert untouched["traces.id"] == 6 and untouched["messages.trace_id"] == 8
    assert untouched["a2a_tasks.id"] == 3 and untouched["subagent_sessions.public_id"] == 2
    with identity.acting_as(owner):
        empty = await trace_stub.DeleteTraces(ts.DeleteTracesRequest())
    assert empty == ts.DeleteTracesResponse()


async def test_other_owner_gets_not_found_on_every_rpc(
    trace_stub, trace_engine, unique, message_stub, subagent_stub, task_stub, stubs
):
    """User B probing user A's ids gets NOT_FOUND with the same message as for ids that do not exist."""
    a, b = f"a-{unique}", f"b-{unique}"
    await new_trace(trace_stub, b)  # B exists and owns something
    trace = await new_trace(trace_stub, a)
    await append(message_stub, a, trace.id, "q")
    message = await append(message_stub, a, trace.id, "", ASSISTANT)
    task = await _task(stubs, a, trace.id)
    sub = await _subagent(stubs, a, trace.id, message.id, "s")
    title_mask = field_mask_pb2.FieldMask(paths=["title"])
    content_mask = field_mask_pb2.FieldMask(paths=["content"])
    status_mask = field_mask_pb2.FieldMask(paths=["status"])
    missing = {
        "trace": "nope-" + unique,
        "message": 987_654_321,
        "task": "nope-" + unique,
        "sub": "nope-" + unique,
    }
    real = {"trace": trace.id, "message": message.id, "task": task.id, "sub": sub.id}

    def calls(ids):
        t, m, k, s = ids["trace"], ids["message"], ids["task"], ids["sub"]
        return {
            "GetTrace": lambda: trace_stub.GetTrace(ts.GetTraceRequest(trace_id=t)),
            "GetTrace(full)": lambda: trace_stub.GetTrace(
                ts.GetTraceRequest(trace_id=t, view=ts.TRACE_VIEW_FULL)
            ),
            "UpdateTrace": lambda: trace_stub.UpdateTrace(
                ts.UpdateTraceRequest(trace=tp.Trace(id=t, title="x"), update_mask=title_mask)
            ),
            "DeleteTrace": lambda: trace_stub.DeleteTrace(ts.DeleteTraceRequest(trace_id=t)),
            "SetTraceHead": lambda: trace_stub.SetTraceHead(
                ts.SetTraceHeadRequest(trace_id=t, head_sequence=1)
            ),
            "AppendMessages": lambda: message_stub.AppendMessages(
                ms.AppendMessagesRequest(trace_id=t, messages=[tp.Message(role=tp.MESSAGE_ROLE_USER)])
            ),
            "BeginTurn": lambda: message_stub.BeginTurn(
                ms.BeginTurnRequest(
                    trace_id=t,
                    user_message=tp.Message(role=tp.MESSAGE_ROLE_USER, content="q"),
                    assistant_message=tp.Message(role=ASSISTANT, status=tp.MESSAGE_STATUS_PENDING),
                )
            ),
            "UpdateMessage": lambda: message_stub.UpdateMessage(
                ms.UpdateMessageRequest(message=tp.Message(id=m, content="x"), update_mask=content_mask)
            ),
            "GetMessage": lambda: message_stub.GetMessage(ms.GetMessageRequest(message_id=m)),
            "ListMessages": lambda: message_stub.ListMessages(ms.ListMessagesRequest(trace_id=t)),
            "ListMessages(full)": lambda: message_stub.ListMessages(
                ms.ListMessagesRequest(trace_id=t, mode=ms.PATH_MODE_ALL, view=ms.MESSAGE_VIEW_FULL)
            ),
            "CreateA2ATask(caller)": lambda: task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(task=tp.A2ATask(callee_agent="coder", caller_trace_id=t))
            ),
            "CreateA2ATask(continue)": lambda: task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder"),
                    continue_trace_id=task.trace_id if t == trace.id else t,
                )
            ),
            "UpdateA2ATask": lambda: task_stub.UpdateA2ATask(
                tks.UpdateA2ATaskRequest(task_id=k, state=tp.TASK_STATE_CANCELED)
            ),
            "GetA2ATask": lambda: task_stub.GetA2ATask(tks.GetA2ATaskRequest(task_id=k)),
            "ListA2ATasks": lambda: task_stub.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=t)),
            "CreateSubagentSessions": lambda: subagent_stub.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(
                    subagents=[tp.SubagentSession(trace_id=t, parent_message_id=m)]
                )
            ),
            "UpdateSubagentSession": lambda: subagent_stub.UpdateSubagentSession(
                sbs.UpdateSubagentSessionRequest(
                    subagent=tp.SubagentSession(id=s, status=ev.SUBAGENT_STATUS_CANCELLED),
                    update_mask=status_mask,
                )
            ),
            "UpdateSubagentSessions": lambda: subagent_stub.UpdateSubagentSessions(
                sbs.UpdateSubagentSessionsRequest(
                    updates=[
                        sbs.UpdateSubagentSessionRequest(
                            subagent=tp.SubagentSession(id=s, status=ev.SUBAGENT_STATUS_CANCELLED),
                            update_mask=status_mask,
                        )
                    ]
                )
            ),
            "GetSubagentSession": lambda: subagent_stub.GetSubagentSession(
                sbs.GetSubagentSessionRequest(subagent_id=s)
            ),
            "ListSubagentSessions": lambda: subagent_stub.ListSubagentSessions(
                sbs.ListSubagentSessionsRequest(trace_id=t)
            ),
            "ListSubagentSessions(anchor)": lambda: subagent_stub.ListSubagentSessions(
                sbs.ListSubagentSessionsRequest(trace_id=t, parent_message_id=m)
            ),
        }

    for stranger in (b, f"never-{unique}"):
        probes, absent = calls(real), calls(missing)
        with identity.acting_as(stranger):
            for name, call in probes.items():
                probe, miss = await error_of(call()), await error_of(absent[name]())
                assert probe.code() == grpc.StatusCode.NOT_FOUND, name
                assert (probe.code(), probe.details()) == (miss.code(), miss.details()), name
    # Nothing of A's changed.
    with identity.acting_as(a):
        got = await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace.id, view=ts.TRACE_VIEW_FULL))
        assert (got.message_count, got.trace.title, got.trace.head_sequence) == (2, "", 2)
        assert (await task_stub.GetA2ATask(tks.GetA2ATaskRequest(task_id=task.id))).task.state == (
            tp.TASK_STATE_SUBMITTED
        )
        listed = await subagent_stub.ListSubagentSessions(sbs.ListSubagentSessionsRequest(trace_id=trace.id))
        assert [r.status for r in listed.subagents] == [ev.SUBAGENT_STATUS_QUEUED]
        tasks = await task_stub.ListA2ATasks(tks.ListA2ATasksRequest(caller_trace_id=trace.id))
        assert [t.id for t in tasks.tasks] == [task.id]
    with identity.acting_as(b):
        assert len((await trace_stub.DeleteTraces(ts.DeleteTracesRequest())).deleted_trace_ids) == 1
    assert await count_rows(trace_engine, "SELECT count(*) FROM traces WHERE id = :s", s=trace.id) == 1
    # No stranger became a user by probing.
    users = "SELECT count(*) FROM users WHERE name = :u"
    assert await count_rows(trace_engine, users, u=f"never-{unique}") == 0
    # The mesh's own principal is no user: UNAUTHENTICATED, not a lookup.
    mesh = await error_of(trace_stub.GetTrace(ts.GetTraceRequest(trace_id=trace.id)))
    assert (mesh.code(), mesh.details()) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "this call needs a user's identity",
    )
