"""Traces: create, get, list (hidden kinds, newest first, paging), update, a new user's first traces."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import field_mask_pb2

from agentmesh.libs import identity
from agentmesh.trace.v1 import task_service_pb2 as tks
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import append, code_of, error_of, new_trace, recent

BAD = grpc.StatusCode.INVALID_ARGUMENT


async def _all_traces(stub, owner, page_size, token=""):
    """Every trace id of the listing from `token` on, and how many pages it took."""
    ids, pages = [], 0
    with identity.acting_as(owner):
        while True:
            resp = await stub.ListTraces(ts.ListTracesRequest(page_size=page_size, page_token=token))
            ids += [t.id for t in resp.traces]
            pages += 1
            token = resp.next_page_token
            if not token:
                return ids, pages


async def test_list_hides_a2a_and_subagent_traces(trace_stub, unique, task_stub):
    owner = f"u-{unique}"
    chat = await new_trace(trace_stub, owner, title="chat")
    hidden_a2a = await new_trace(trace_stub, owner, kind=tp.TRACE_KIND_A2A)
    shown_a2a = await new_trace(trace_stub, owner, kind=tp.TRACE_KIND_A2A, visible_in_sidebar=True)
    hidden_sub = await new_trace(trace_stub, owner, kind=tp.TRACE_KIND_SUBAGENT)
    with identity.acting_as(owner):
        task = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_agent="general", caller_trace_id=chat.id)
                )
            )
        ).task
        visible_task = (
            await task_stub.CreateA2ATask(
                tks.CreateA2ATaskRequest(
                    task=tp.A2ATask(callee_agent="coder", caller_trace_id=chat.id, visible_in_sidebar=True)
                )
            )
        ).task
    listed, _ = await _all_traces(trace_stub, owner, 50)
    assert set(listed) == {chat.id, shown_a2a.id, visible_task.trace_id}
    assert len(listed) == 3
    assert not {hidden_a2a.id, hidden_sub.id, task.trace_id} & set(listed)
    with identity.acting_as(owner):
        # Hidden traces are still readable by id.
        got = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=task.trace_id))).trace
        assert (got.kind, got.agent, got.owner, got.visible_in_sidebar) == (
            tp.TRACE_KIND_A2A,
            "coder",
            owner,
            False,
        )
        # Making a hidden trace visible puts it in the list.
        mask = field_mask_pb2.FieldMask(paths=["visible_in_sidebar"])
        shown = await trace_stub.UpdateTrace(
            ts.UpdateTraceRequest(trace=tp.Trace(id=hidden_sub.id, visible_in_sidebar=True), update_mask=mask)
        )
        assert (shown.trace.visible_in_sidebar, shown.trace.kind) == (True, tp.TRACE_KIND_SUBAGENT)
    assert hidden_sub.id in (await _all_traces(trace_stub, owner, 50))[0]


async def test_list_newest_first_and_paging(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    created = [await new_trace(trace_stub, owner, title=f"s{i}") for i in range(7)]
    ids, pages = await _all_traces(trace_stub, owner, 3)
    assert ids == [t.id for t in reversed(created)] and pages == 3
    # Activity moves a trace to the top; a fresh listing reflects it.
    await append(message_stub, owner, created[2].id, "bump")
    ids, _ = await _all_traces(trace_stub, owner, 2)
    assert ids[0] == created[2].id and sorted(ids) == sorted(t.id for t in created)
    # A page token stays valid while new traces arrive: no trace of the old order repeats.
    with identity.acting_as(owner):
        first = await trace_stub.ListTraces(ts.ListTracesRequest(page_size=4))
    assert len(first.traces) == 4 and first.next_page_token
    await new_trace(trace_stub, owner, title="late")
    rest, _ = await _all_traces(trace_stub, owner, 4, first.next_page_token)
    seen = [t.id for t in first.traces] + rest
    assert len(seen) == len(set(seen)) == 7
    with identity.acting_as(owner):
        for bad in (
            ts.ListTracesRequest(page_token="%%%"),  # not base64
            ts.ListTracesRequest(page_token="bm90anNvbg"),  # base64 of "notjson"
            ts.ListTracesRequest(page_size=-1),
        ):
            error = await error_of(trace_stub.ListTraces(bad))
            assert error.code() == BAD, bad
        assert (await error_of(trace_stub.ListTraces(ts.ListTracesRequest(page_token="%%%")))).details() == (
            "invalid page_token"
        )
        big = await trace_stub.ListTraces(ts.ListTracesRequest(page_size=10_000))
    assert len(big.traces) == 8 and big.next_page_token == ""
    # The acting user comes from the call: the mesh's own principal has no traces to list.
    error = await error_of(trace_stub.ListTraces(ts.ListTracesRequest()))
    assert (error.code(), error.details()) == (
        grpc.StatusCode.UNAUTHENTICATED,
        "this call needs a user's identity",
    )


async def test_create_get_and_update_trace(trace_stub, unique):
    owner = f"u-{unique}"
    t = await new_trace(trace_stub, owner, title="first", trace_id=f"sess-{unique}")
    assert (t.id, t.owner, t.kind, t.agent, t.title, t.head_sequence, t.visible_in_sidebar) == (
        f"sess-{unique}",
        owner,
        tp.TRACE_KIND_CHAT,
        "general",
        "first",
        0,
        False,
    )
    assert recent(t.create_time) and t.update_time == t.create_time
    random_id = await new_trace(trace_stub, owner)
    assert len(random_id.id) == 36 and random_id.id != t.id  # a UUID
    with identity.acting_as(owner):
        dup = ts.CreateTraceRequest(trace=tp.Trace(agent="general"), trace_id=t.id)
        error = await error_of(trace_stub.CreateTrace(dup))
        assert (error.code(), error.details()) == (grpc.StatusCode.ALREADY_EXISTS, "trace already exists")
        for bad_id in ("a b/c", "agent://host/x", "x" * 65, ".dot", "a:b"):
            bad = ts.CreateTraceRequest(trace=tp.Trace(agent="general"), trace_id=bad_id)
            assert await code_of(trace_stub.CreateTrace(bad)) == BAD, bad_id

        basic = await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=t.id))
        assert basic.trace == t and (basic.message_count, basic.main_path_count) == (0, 0)

        title = field_mask_pb2.FieldMask(paths=["title"])
        renamed = await trace_stub.UpdateTrace(
            ts.UpdateTraceRequest(
                trace=tp.Trace(id=t.id, title="second", visible_in_sidebar=True), update_mask=title
            )
        )
        # Only the masked field changes.
        assert (renamed.trace.title, renamed.trace.visible_in_sidebar) == ("second", False)
        assert renamed.trace.update_time.ToNanoseconds() > t.update_time.ToNanoseconds()
        got = (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=t.id))).trace
        assert got == renamed.trace
        for paths in ([], ["owner"], ["title", "kind"], ["head_sequence"]):
            bad = ts.UpdateTraceRequest(trace=tp.Trace(id=t.id, title="x"), update_mask={"paths": paths})
            assert await code_of(trace_stub.UpdateTrace(bad)) == BAD, paths
        too_long = ts.UpdateTraceRequest(trace=tp.Trace(id=t.id, title="x" * 501), update_mask=title)
        assert await code_of(trace_stub.UpdateTrace(too_long)) == BAD
        no_id = ts.UpdateTraceRequest(trace=tp.Trace(title="x"), update_mask=title)
        assert await code_of(trace_stub.UpdateTrace(no_id)) == BAD
        assert (await trace_stub.GetTrace(ts.GetTraceRequest(trace_id=t.id))).trace.title == "second"


async def test_concurrent_first_traces_of_a_new_owner(trace_stub, unique):
    """The owner user is created once even when its first traces arrive together."""
    owner = f"u-{unique}"
    created = await asyncio.gather(*(new_trace(trace_stub, owner, title=str(i)) for i in range(10)))
    assert {t.owner for t in created} == {owner}
    with identity.acting_as(owner):
        listed = await trace_stub.ListTraces(ts.ListTracesRequest())
    assert sorted(t.id for t in listed.traces) == sorted(t.id for t in created)
