"""Cascade deletes leave no rows behind; another owner's ids answer exactly like missing ones."""

from __future__ import annotations

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.v1 import events_pb2, trace_pb2
from agentmesh.v1 import trace_service_pb2 as ts
from tests.trace.conftest import append, count_rows, error_of, new_session

ASSISTANT = trace_pb2.MESSAGE_ROLE_ASSISTANT
_GONE = "NOT EXISTS (SELECT 1 FROM sessions s WHERE s.id = {})"
ORPHANS = {
    "messages": "SELECT count(*) FROM messages m WHERE " + _GONE.format("m.session_id"),
    "a2a_tasks": "SELECT count(*) FROM a2a_tasks t WHERE "
    + _GONE.format("t.session_id")
    + " OR (t.caller_session_id IS NOT NULL AND "
    + _GONE.format("t.caller_session_id")
    + ")",
    "subagent_sessions": "SELECT count(*) FROM subagent_sessions r WHERE "
    + _GONE.format("r.session_id")
    + " OR "
    + _GONE.format("r.child_session_id")
    + " OR NOT EXISTS (SELECT 1 FROM messages m WHERE m.id = r.parent_message_id)",
}


async def _task(stub, owner, caller_session_id, callee="coder"):
    req = ts.CreateA2ATaskRequest(
        owner=owner, callee_agent=callee, caller_agent="general", caller_session_id=caller_session_id
    )
    return (await stub.CreateA2ATask(req)).task


async def _subagent(stub, owner, session_id, anchor_id, name):
    sub = trace_pb2.SubagentSession(session_id=session_id, parent_message_id=anchor_id, name=name, goal=name)
    return (
        await stub.CreateSubagentSession(ts.CreateSubagentSessionRequest(owner=owner, subagent=sub))
    ).subagent


async def _tree(stub, owner):
    """A chat session with A2A calls and subagents nested three levels deep; returns (root, every
    session id under it, task ids, subagent ids)."""
    root = await new_session(stub, owner)
    await append(stub, owner, root.id, "go")
    anchor = await append(stub, owner, root.id, "", ASSISTANT)
    t1 = await _task(stub, owner, root.id)
    await append(
        stub, owner, t1.session_id, "hi coder", source=trace_pb2.MESSAGE_SOURCE_A2A, a2a_task_id=t1.id
    )
    callee_anchor = await append(stub, owner, t1.session_id, "", ASSISTANT)
    t2 = await _task(stub, owner, t1.session_id, "researcher")  # the callee calls on
    await append(stub, owner, t2.session_id, "hi researcher", source=trace_pb2.MESSAGE_SOURCE_A2A)
    k1 = await _subagent(stub, owner, root.id, anchor.id, "k1")
    await append(stub, owner, k1.child_session_id, "sub work", source=trace_pb2.MESSAGE_SOURCE_SUBAGENT)
    t3 = await _task(stub, owner, k1.child_session_id)  # a subagent invokes an agent
    await append(stub, owner, t3.session_id, "from the subagent")
    k2 = await _subagent(stub, owner, t1.session_id, callee_anchor.id, "k2")  # the callee delegates
    await append(stub, owner, k2.child_session_id, "nested sub work")
    sessions = {
        root.id,
        t1.session_id,
        t2.session_id,
        t3.session_id,
        k1.child_session_id,
        k2.child_session_id,
    }
    return root, sessions, {t1.id, t2.id, t3.id}, {k1.id, k2.id}


async def _left(engine, sessions, tasks, subagents):
    """Rows still present for the given ids, per table."""
    out = {}
    for table, column, ids in (
        ("sessions", "id", sessions),
        ("messages", "session_id", sessions),
        ("a2a_tasks", "id", tasks),
        ("a2a_tasks", "session_id", sessions),
        ("a2a_tasks", "caller_session_id", sessions),
        ("subagent_sessions", "id", subagents),
        ("subagent_sessions", "session_id", sessions),
        ("subagent_sessions", "child_session_id", sessions),
    ):
        params = {f"p{i}": v for i, v in enumerate(ids)}
        marks = ", ".join(f":{k}" for k in params)
        out[f"{table}.{column}"] = await count_rows(
            engine, f"SELECT count(*) FROM {table} WHERE {column} IN ({marks})", **params
        )
    return out


async def _orphans(engine):
    return {table: await count_rows(engine, sql) for table, sql in ORPHANS.items()}


async def test_delete_one_session_cascades(trace_stub, trace_engine, unique):
    owner = f"u-{unique}"
    root, sessions, tasks, subagents = await _tree(trace_stub, owner)
    keep = await new_session(trace_stub, owner)
    await append(trace_stub, owner, keep.id, "stay")
    before = await _left(trace_engine, sessions, tasks, subagents)
    assert before["sessions.id"] == 6 and before["messages.session_id"] == 8
    assert before["a2a_tasks.id"] == 3 and before["subagent_sessions.id"] == 2

    await trace_stub.DeleteSession(ts.DeleteSessionRequest(owner=owner, session_id=root.id))
    after = await _left(trace_engine, sessions, tasks, subagents)
    assert after == dict.fromkeys(after, 0)
    assert await _orphans(trace_engine) == dict.fromkeys(ORPHANS, 0)
    kept = await trace_stub.GetTrace(ts.GetTraceRequest(owner=owner, session_id=keep.id))
    assert kept.message_count == 1
    error = await error_of(trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=root.id)))
    assert error.code() == grpc.StatusCode.NOT_FOUND


async def test_delete_all_sessions_cascades(trace_stub, trace_engine, unique):
    owner, other = f"u-{unique}", f"o-{unique}"
    _, sessions_a, tasks_a, subs_a = await _tree(trace_stub, owner)
    _, sessions_b, tasks_b, subs_b = await _tree(trace_stub, owner)
    plain = await new_session(trace_stub, owner)
    _, other_sessions, other_tasks, other_subs = await _tree(trace_stub, other)

    resp = await trace_stub.DeleteSessions(ts.DeleteSessionsRequest(owner=owner))
    assert resp.deleted_count == 13
    after = await _left(
        trace_engine, sessions_a | sessions_b | {plain.id}, tasks_a | tasks_b, subs_a | subs_b
    )
    assert after == dict.fromkeys(after, 0)
    owned = "SELECT count(*) FROM sessions s JOIN users u ON u.id = s.user_id WHERE u.name = :u"
    assert await count_rows(trace_engine, owned, u=owner) == 0
    assert await _orphans(trace_engine) == dict.fromkeys(ORPHANS, 0)
    untouched = await _left(trace_engine, other_sessions, other_tasks, other_subs)
    assert untouched["sessions.id"] == 6 and untouched["messages.session_id"] == 8
    assert (await trace_stub.DeleteSessions(ts.DeleteSessionsRequest(owner=owner))).deleted_count == 0


async def test_other_owner_gets_not_found_on_every_rpc(trace_stub, trace_engine, unique):
    """User B probing user A's ids gets NOT_FOUND with the same message as for ids that do not exist."""
    a, b = f"a-{unique}", f"b-{unique}"
    await new_session(trace_stub, b)  # B exists and owns something
    session = await new_session(trace_stub, a)
    await append(trace_stub, a, session.id, "q")
    message = await append(trace_stub, a, session.id, "", ASSISTANT)
    task = await _task(trace_stub, a, session.id)
    sub = await _subagent(trace_stub, a, session.id, message.id, "s")
    mask = field_mask_pb2.FieldMask(paths=["content"])
    status_mask = field_mask_pb2.FieldMask(paths=["status"])
    missing = {
        "session": "nope-" + unique,
        "message": 987_654_321,
        "task": "nope-" + unique,
        "sub": 987_654_321,
    }
    real = {"session": session.id, "message": message.id, "task": task.id, "sub": sub.id}

    def calls(owner, ids):
        s, m, t, k = ids["session"], ids["message"], ids["task"], ids["sub"]
        return {
            "GetSession": lambda: trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=s)),
            "UpdateSession": lambda: trace_stub.UpdateSession(
                ts.UpdateSessionRequest(owner=owner, session_id=s, title="x")
            ),
            "DeleteSession": lambda: trace_stub.DeleteSession(
                ts.DeleteSessionRequest(owner=owner, session_id=s)
            ),
            "AppendMessage": lambda: trace_stub.AppendMessage(
                ts.AppendMessageRequest(
                    owner=owner, message=trace_pb2.Message(session_id=s, role=trace_pb2.MESSAGE_ROLE_USER)
                )
            ),
            "UpdateMessage": lambda: trace_stub.UpdateMessage(
                ts.UpdateMessageRequest(
                    owner=owner, message=trace_pb2.Message(id=m, content="x"), update_mask=mask
                )
            ),
            "ListMessages": lambda: trace_stub.ListMessages(
                ts.ListMessagesRequest(owner=owner, session_id=s)
            ),
            "SetHead": lambda: trace_stub.SetHead(
                ts.SetHeadRequest(owner=owner, session_id=s, head_sequence=1)
            ),
            "GetTrace": lambda: trace_stub.GetTrace(ts.GetTraceRequest(owner=owner, session_id=s)),
            "CreateA2ATask(caller)": lambda: trace_stub.CreateA2ATask(
                ts.CreateA2ATaskRequest(owner=owner, callee_agent="coder", caller_session_id=s)
            ),
            "CreateA2ATask(continue)": lambda: trace_stub.CreateA2ATask(
                ts.CreateA2ATaskRequest(
                    owner=owner,
                    callee_agent="coder",
                    continue_session_id=task.session_id if s == session.id else s,
                )
            ),
            "UpdateA2ATask": lambda: trace_stub.UpdateA2ATask(
                ts.UpdateA2ATaskRequest(owner=owner, task_id=t, state=trace_pb2.TASK_STATE_CANCELED)
            ),
            "GetA2ATask": lambda: trace_stub.GetA2ATask(ts.GetA2ATaskRequest(owner=owner, task_id=t)),
            "ListA2ATasks": lambda: trace_stub.ListA2ATasks(
                ts.ListA2ATasksRequest(owner=owner, caller_session_id=s)
            ),
            "CreateSubagentSession": lambda: trace_stub.CreateSubagentSession(
                ts.CreateSubagentSessionRequest(
                    owner=owner, subagent=trace_pb2.SubagentSession(session_id=s, parent_message_id=m)
                )
            ),
            "UpdateSubagentSession": lambda: trace_stub.UpdateSubagentSession(
                ts.UpdateSubagentSessionRequest(
                    owner=owner,
                    subagent=trace_pb2.SubagentSession(id=k, status=events_pb2.SUBAGENT_STATUS_CANCELLED),
                    update_mask=status_mask,
                )
            ),
            "GetSubagentSession": lambda: trace_stub.GetSubagentSession(
                ts.GetSubagentSessionRequest(owner=owner, subagent_id=k)
            ),
            "ListSubagentSessions": lambda: trace_stub.ListSubagentSessions(
                ts.ListSubagentSessionsRequest(owner=owner, session_id=s)
            ),
        }

    for stranger in (b, f"never-{unique}"):
        probes, absent = calls(stranger, real), calls(stranger, missing)
        for name, call in probes.items():
            probe, miss = await error_of(call()), await error_of(absent[name]())
            assert probe.code() == grpc.StatusCode.NOT_FOUND, name
            assert (probe.code(), probe.details()) == (miss.code(), miss.details()), name
    # Nothing of A's changed.
    trace = await trace_stub.GetTrace(ts.GetTraceRequest(owner=a, session_id=session.id))
    assert (trace.message_count, trace.session.title) == (2, "")
    assert (await trace_stub.GetA2ATask(ts.GetA2ATaskRequest(owner=a, task_id=task.id))).task.state == (
        trace_pb2.TASK_STATE_SUBMITTED
    )
    listed = await trace_stub.ListSubagentSessions(
        ts.ListSubagentSessionsRequest(owner=a, session_id=session.id)
    )
    assert [r.status for r in listed.subagents] == [events_pb2.SUBAGENT_STATUS_QUEUED]
    assert (await trace_stub.DeleteSessions(ts.DeleteSessionsRequest(owner=b))).deleted_count == 1
    assert await count_rows(trace_engine, "SELECT count(*) FROM sessions WHERE id = :s", s=session.id) == 1
    # An empty owner is a bad request, not a lookup.
    empty = await error_of(trace_stub.GetSession(ts.GetSessionRequest(owner="", session_id=session.id)))
    assert empty.code() == grpc.StatusCode.INVALID_ARGUMENT
