"""Sessions: create, list (hidden kinds, newest first, paging), update, A2A tasks, subagent rows, keys."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from google.protobuf import field_mask_pb2, struct_pb2, timestamp_pb2

from agentmesh.v1 import events_pb2, trace_pb2
from agentmesh.v1 import trace_service_pb2 as ts
from tests.trace.conftest import append, code_of, count_rows, new_session

BAD = grpc.StatusCode.INVALID_ARGUMENT
S = events_pb2


async def _all_sessions(stub, owner, page_size):
    ids, token, pages = [], "", 0
    while True:
        resp = await stub.ListSessions(
            ts.ListSessionsRequest(owner=owner, page_size=page_size, page_token=token)
        )
        ids += [s.id for s in resp.sessions]
        pages += 1
        token = resp.next_page_token
        if not token:
            return ids, pages


async def test_list_hides_a2a_and_subagent_sessions(trace_stub, unique):
    owner = f"u-{unique}"
    chat = await new_session(trace_stub, owner, title="chat")
    hidden_a2a = await new_session(trace_stub, owner, kind=trace_pb2.SESSION_KIND_A2A)
    shown_a2a = await new_session(trace_stub, owner, kind=trace_pb2.SESSION_KIND_A2A, visible_in_sidebar=True)
    hidden_sub = await new_session(trace_stub, owner, kind=trace_pb2.SESSION_KIND_SUBAGENT)
    task = (
        await trace_stub.CreateA2ATask(
            ts.CreateA2ATaskRequest(
                owner=owner, callee_agent="coder", caller_agent="general", caller_session_id=chat.id
            )
        )
    ).task
    visible_task = (
        await trace_stub.CreateA2ATask(
            ts.CreateA2ATaskRequest(
                owner=owner, callee_agent="coder", caller_session_id=chat.id, visible_in_sidebar=True
            )
        )
    ).task
    listed, _ = await _all_sessions(trace_stub, owner, 50)
    assert set(listed) == {chat.id, shown_a2a.id, visible_task.session_id}
    assert not {hidden_a2a.id, hidden_sub.id, task.session_id} & set(listed)
    # Hidden sessions are still readable by id.
    got = await trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=task.session_id))
    assert (got.session.kind, got.session.agent, got.session.owner) == (
        trace_pb2.SESSION_KIND_A2A,
        "coder",
        owner,
    )
    # Making a hidden session visible puts it in the list.
    mask = field_mask_pb2.FieldMask(paths=["visible_in_sidebar"])
    await trace_stub.UpdateSession(
        ts.UpdateSessionRequest(
            owner=owner, session_id=hidden_sub.id, visible_in_sidebar=True, update_mask=mask
        )
    )
    assert hidden_sub.id in (await _all_sessions(trace_stub, owner, 50))[0]


async def test_list_newest_first_and_paging(trace_stub, unique):
    owner = f"u-{unique}"
    created = [await new_session(trace_stub, owner, title=f"s{i}") for i in range(7)]
    ids, pages = await _all_sessions(trace_stub, owner, 3)
    assert ids == [s.id for s in reversed(created)] and pages == 3
    # Activity moves a session to the top; a fresh listing reflects it.
    await append(trace_stub, owner, created[2].id, "bump")
    ids, _ = await _all_sessions(trace_stub, owner, 2)
    assert ids[0] == created[2].id and sorted(ids) == sorted(s.id for s in created)
    # A page token stays valid while new sessions arrive: no session of the old order repeats.
    first = await trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner, page_size=4))
    await new_session(trace_stub, owner, title="late")
    rest, _ = await _all_sessions_from(trace_stub, owner, 4, first.next_page_token)
    seen = [s.id for s in first.sessions] + rest
    assert len(seen) == len(set(seen)) == 7
    assert (
        await code_of(trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner, page_token="%%%"))) == BAD
    )
    assert (
        await code_of(trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner, page_token="bm90anNvbg")))
        == BAD
    )
    assert await code_of(trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner, page_size=-1))) == BAD
    assert await code_of(trace_stub.ListSessions(ts.ListSessionsRequest(owner=""))) == BAD
    big = await trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner, page_size=10_000))
    assert len(big.sessions) == 8 and big.next_page_token == ""


async def _all_sessions_from(stub, owner, page_size, token):
    ids = []
    while token:
        resp = await stub.ListSessions(
            ts.ListSessionsRequest(owner=owner, page_size=page_size, page_token=token)
        )
        ids += [s.id for s in resp.sessions]
        token = resp.next_page_token
    return ids, None


async def test_create_and_update_session(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner, title="first", session_id=f"sess-{unique}")
    assert (s.id, s.owner, s.kind, s.head_sequence, s.visible_in_sidebar) == (
        f"sess-{unique}",
        owner,
        trace_pb2.SESSION_KIND_CHAT,
        0,
        False,
    )
    assert s.create_time.seconds > 0
    dup = ts.CreateSessionRequest(owner=owner, agent="general", session_id=s.id)
    assert await code_of(trace_stub.CreateSession(dup)) == grpc.StatusCode.ALREADY_EXISTS
    bad_id = ts.CreateSessionRequest(owner=owner, agent="general", session_id="a b/c")
    assert await code_of(trace_stub.CreateSession(bad_id)) == BAD
    renamed = await trace_stub.UpdateSession(
        ts.UpdateSessionRequest(owner=owner, session_id=s.id, title="second")
    )
    assert renamed.session.title == "second" and not renamed.session.visible_in_sidebar
    bad_mask = field_mask_pb2.FieldMask(paths=["owner"])
    bad = ts.UpdateSessionRequest(owner=owner, session_id=s.id, update_mask=bad_mask)
    assert await code_of(trace_stub.UpdateSession(bad)) == BAD


async def test_a2a_tasks(trace_stub, trace_engine, unique):
    owner = f"u-{unique}"
    caller = await new_session(trace_stub, owner)
    context = struct_pb2.Struct()
    context.update({"toolCallId": "call-1", "depth": 1})
    task = (
        await trace_stub.CreateA2ATask(
            ts.CreateA2ATaskRequest(
                owner=owner,
                callee_agent="coder",
                caller_agent="general",
                caller_session_id=caller.id,
                caller_context=context,
            )
        )
    ).task
    assert (task.state, task.callee_agent, task.caller_agent, task.owner) == (
        trace_pb2.TASK_STATE_SUBMITTED,
        "coder",
        "general",
        owner,
    )
    assert task.caller_context["toolCallId"] == "call-1" and not task.visible_in_sidebar
    callee = (
        await trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=task.session_id))
    ).session
    assert (callee.kind, callee.agent, callee.visible_in_sidebar) == (
        trace_pb2.SESSION_KIND_A2A,
        "coder",
        False,
    )

    again = (
        await trace_stub.CreateA2ATask(
            ts.CreateA2ATaskRequest(
                owner=owner,
                callee_agent="coder",
                caller_session_id=caller.id,
                continue_session_id=task.session_id,
            )
        )
    ).task
    assert again.session_id == task.session_id and again.id != task.id
    sessions = await count_rows(
        trace_engine, "SELECT count(*) FROM sessions WHERE id = :id", id=task.session_id
    )
    assert sessions == 1
    wrong_agent = ts.CreateA2ATaskRequest(
        owner=owner, callee_agent="researcher", continue_session_id=task.session_id
    )
    assert await code_of(trace_stub.CreateA2ATask(wrong_agent)) == BAD
    not_a2a = ts.CreateA2ATaskRequest(owner=owner, callee_agent="general", continue_session_id=caller.id)
    assert await code_of(trace_stub.CreateA2ATask(not_a2a)) == grpc.StatusCode.FAILED_PRECONDITION
    unknown = ts.CreateA2ATaskRequest(owner=owner, callee_agent="nobody", caller_session_id=caller.id)
    assert await code_of(trace_stub.CreateA2ATask(unknown)) == BAD

    working = await trace_stub.UpdateA2ATask(
        ts.UpdateA2ATaskRequest(owner=owner, task_id=task.id, state=trace_pb2.TASK_STATE_WORKING)
    )
    assert working.task.state == trace_pb2.TASK_STATE_WORKING
    await trace_stub.UpdateA2ATask(
        ts.UpdateA2ATaskRequest(owner=owner, task_id=task.id, state=trace_pb2.TASK_STATE_COMPLETED)
    )
    reopen = ts.UpdateA2ATaskRequest(owner=owner, task_id=task.id, state=trace_pb2.TASK_STATE_WORKING)
    assert await code_of(trace_stub.UpdateA2ATask(reopen)) == grpc.StatusCode.FAILED_PRECONDITION
    got = await trace_stub.GetA2ATask(ts.GetA2ATaskRequest(owner=owner, task_id=task.id))
    assert got.task.state == trace_pb2.TASK_STATE_COMPLETED
    listed = await trace_stub.ListA2ATasks(ts.ListA2ATasksRequest(owner=owner, caller_session_id=caller.id))
    assert [t.id for t in listed.tasks] == [task.id, again.id]


async def test_subagent_rows_and_transitions(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    await append(trace_stub, owner, s.id, "split this")
    anchor = await append(trace_stub, owner, s.id, "", trace_pb2.MESSAGE_ROLE_ASSISTANT)
    other_anchor = await append(trace_stub, owner, s.id, "", trace_pb2.MESSAGE_ROLE_ASSISTANT)

    async def create(name, order, anchor_id=anchor.id, **kw):
        sub = trace_pb2.SubagentSession(
            session_id=s.id, parent_message_id=anchor_id, name=name, goal=f"do {name}", sort_order=order, **kw
        )
        return (
            await trace_stub.CreateSubagentSession(ts.CreateSubagentSessionRequest(owner=owner, subagent=sub))
        ).subagent

    b = await create("b", 1, preset_agent="researcher", tool_names=["search"], batch_title="research")
    a = await create("a", 0, parent_tool_call_id="call-7")
    z = await create("z", 0, anchor_id=other_anchor.id)
    assert (a.status, a.parent_agent, a.source_type, a.parent_tool_call_id) == (
        S.SUBAGENT_STATUS_QUEUED,
        "general",
        "clone",
        "call-7",
    )
    assert (b.preset_agent, b.source_type, list(b.tool_names), b.batch_title) == (
        "researcher",
        "preset",
        ["search"],
        "research",
    )
    child = (
        await trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=b.child_session_id))
    ).session
    assert (child.kind, child.agent) == (trace_pb2.SESSION_KIND_SUBAGENT, "researcher")
    assert (
        await trace_stub.GetSession(ts.GetSessionRequest(owner=owner, session_id=a.child_session_id))
    ).session.agent == "general"

    one = await trace_stub.ListSubagentSessions(
        ts.ListSubagentSessionsRequest(owner=owner, session_id=s.id, parent_message_id=anchor.id)
    )
    assert [r.name for r in one.subagents] == ["a", "b"]
    every = await trace_stub.ListSubagentSessions(
        ts.ListSubagentSessionsRequest(owner=owner, session_id=s.id)
    )
    assert [r.name for r in every.subagents] == ["a", "b", "z"]

    def update(row: Any, status: Any = 0, paths: Any = ("status",), **kw: Any) -> Any:
        sub = trace_pb2.SubagentSession(id=row.id, status=status, **kw)
        mask = field_mask_pb2.FieldMask(paths=list(paths))
        return trace_stub.UpdateSubagentSession(
            ts.UpdateSubagentSessionRequest(owner=owner, subagent=sub, update_mask=mask)
        )

    running = (await update(a, S.SUBAGENT_STATUS_RUNNING)).subagent
    assert running.status == S.SUBAGENT_STATUS_RUNNING and running.start_time.seconds > 0
    assert await code_of(update(a, S.SUBAGENT_STATUS_QUEUED)) == grpc.StatusCode.FAILED_PRECONDITION
    payload = struct_pb2.Struct()
    payload.update({"answer": 42})
    done = (
        await update(
            a,
            S.SUBAGENT_STATUS_COMPLETED,
            ("status", "summary", "result_payload", "token_usage", "model"),
            summary="all done",
            result_payload=payload,
            token_usage=events_pb2.Usage(input_tokens=7, output_tokens=9),
            model="mock-gpt",
        )
    ).subagent
    assert (
        done.status,
        done.summary,
        done.result_payload["answer"],
        done.token_usage.output_tokens,
        done.model,
    ) == (
        S.SUBAGENT_STATUS_COMPLETED,
        "all done",
        42,
        9,
        "mock-gpt",
    )
    assert done.end_time.seconds > 0
    for status in (S.SUBAGENT_STATUS_RUNNING, S.SUBAGENT_STATUS_FAILED, S.SUBAGENT_STATUS_CANCELLED):
        assert await code_of(update(a, status)) == grpc.StatusCode.FAILED_PRECONDITION
    # queued -> cancelled and queued -> failed are allowed; queued -> completed is not.
    assert await code_of(update(z, S.SUBAGENT_STATUS_COMPLETED)) == grpc.StatusCode.FAILED_PRECONDITION
    assert (await update(z, S.SUBAGENT_STATUS_CANCELLED)).subagent.status == S.SUBAGENT_STATUS_CANCELLED
    failed = (await update(b, S.SUBAGENT_STATUS_FAILED, ("status", "error"), error="boom")).subagent
    assert (failed.status, failed.error) == (S.SUBAGENT_STATUS_FAILED, "boom")
    assert await code_of(update(b, paths=())) == BAD
    assert await code_of(update(b, paths=("name",))) == BAD
    stamp = timestamp_pb2.Timestamp(seconds=1_700_000_000)
    timed = (await update(b, paths=("start_time",), start_time=stamp)).subagent
    assert timed.start_time.seconds == 1_700_000_000

    bad_anchor = trace_pb2.SubagentSession(session_id=s.id, parent_message_id=999_999_999, name="x")
    assert (
        await code_of(
            trace_stub.CreateSubagentSession(
                ts.CreateSubagentSessionRequest(owner=owner, subagent=bad_anchor)
            )
        )
        == BAD
    )
    bad_preset = trace_pb2.SubagentSession(
        session_id=s.id, parent_message_id=anchor.id, preset_agent="nobody"
    )
    assert (
        await code_of(
            trace_stub.CreateSubagentSession(
                ts.CreateSubagentSessionRequest(owner=owner, subagent=bad_preset)
            )
        )
        == BAD
    )


async def test_api_keys(trace_stub, trace_engine, unique):
    user = f"u-{unique}"
    created = await trace_stub.CreateApiKey(ts.CreateApiKeyRequest(user=user))
    assert created.user == user and created.api_key.startswith("am_") and len(created.api_key) > 40
    second = await trace_stub.CreateApiKey(ts.CreateApiKeyRequest(user=user))
    assert second.api_key != created.api_key
    for key in (created.api_key, second.api_key):
        assert (await trace_stub.AuthenticateApiKey(ts.AuthenticateApiKeyRequest(api_key=key))).user == user
    for key in ("am_wrong", ""):
        denied = trace_stub.AuthenticateApiKey(ts.AuthenticateApiKeyRequest(api_key=key))
        assert await code_of(denied) == grpc.StatusCode.UNAUTHENTICATED
    assert await code_of(trace_stub.CreateApiKey(ts.CreateApiKeyRequest(user=""))) == BAD
    # Only hashes are stored.
    plain = await count_rows(
        trace_engine, "SELECT count(*) FROM api_keys WHERE key_hash = :k", k=created.api_key
    )
    rows = await count_rows(
        trace_engine,
        "SELECT count(*) FROM api_keys k JOIN users u ON u.id = k.user_id"
        " WHERE u.name = :u AND k.last_used_at IS NOT NULL",
        u=user,
    )
    assert (plain, rows) == (0, 2)


async def test_concurrent_first_sessions_of_a_new_owner(trace_stub, unique):
    """The owner user is created once even when its first sessions arrive together."""
    owner = f"u-{unique}"
    created = await asyncio.gather(*(new_session(trace_stub, owner, title=str(i)) for i in range(10)))
    assert {s.owner for s in created} == {owner}
    listed = await trace_stub.ListSessions(ts.ListSessionsRequest(owner=owner))
    assert len(listed.sessions) == 10
