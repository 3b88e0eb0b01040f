"""Messages: sequences, branches (main path vs all), since_sequence, paging, SetHead, GetTrace, updates."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import field_mask_pb2, struct_pb2

from agentmesh.v1 import events_pb2, trace_pb2
from agentmesh.v1 import trace_service_pb2 as ts
from tests.trace.conftest import append, code_of, new_session

ASSISTANT = trace_pb2.MESSAGE_ROLE_ASSISTANT
MAIN, ALL = trace_pb2.LIST_MODE_MAIN_PATH, trace_pb2.LIST_MODE_ALL


async def _list(stub, owner, session_id, **kw):
    return await stub.ListMessages(ts.ListMessagesRequest(owner=owner, session_id=session_id, **kw))


async def test_branches_main_path_and_all(trace_stub, unique):
    """Two branches off message 2: each head gives its own chain; mode all gives every message."""
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    m1 = await append(trace_stub, owner, s.id, "q1")
    m2 = await append(trace_stub, owner, s.id, "a1", ASSISTANT)
    m3 = await append(trace_stub, owner, s.id, "q2")
    m4 = await append(trace_stub, owner, s.id, "a2", ASSISTANT)
    # A regenerated answer to q1 branches from m1 (a sibling of m2), then continues.
    b5 = await append(trace_stub, owner, s.id, "a1'", ASSISTANT, parent=m1.sequence)
    b6 = await append(trace_stub, owner, s.id, "q2'")
    assert [m.sequence for m in (m1, m2, m3, m4, b5, b6)] == [1, 2, 3, 4, 5, 6]
    assert (m1.parent_sequence, m2.parent_sequence, b5.parent_sequence, b6.parent_sequence) == (0, 1, 1, 5)

    head = await _list(trace_stub, owner, s.id)
    assert [m.content for m in head.messages] == ["q1", "a1'", "q2'"]
    assert head.head_sequence == 6 and head.total == 3

    old = await _list(trace_stub, owner, s.id, mode=MAIN, head_sequence=4)
    assert [m.sequence for m in old.messages] == [1, 2, 3, 4]
    assert old.head_sequence == 4

    everything = await _list(trace_stub, owner, s.id, mode=ALL)
    assert [m.sequence for m in everything.messages] == [1, 2, 3, 4, 5, 6] and everything.total == 6

    # SetHead switches the branch: the default main path and the next parent follow it.
    moved = await trace_stub.SetHead(ts.SetHeadRequest(owner=owner, session_id=s.id, head_sequence=4))
    assert moved.session.head_sequence == 4
    assert [m.sequence for m in (await _list(trace_stub, owner, s.id)).messages] == [1, 2, 3, 4]
    m7 = await append(trace_stub, owner, s.id, "q3")
    assert (m7.sequence, m7.parent_sequence) == (7, 4)

    trace = await trace_stub.GetTrace(ts.GetTraceRequest(owner=owner, session_id=s.id))
    assert (trace.message_count, trace.main_path_count, trace.session.head_sequence) == (7, 5, 7)

    # A new root (parent_sequence 0) starts a disconnected chain.
    root = await append(trace_stub, owner, s.id, "fresh", parent=0)
    assert root.parent_sequence == 0
    assert [m.content for m in (await _list(trace_stub, owner, s.id)).messages] == ["fresh"]


async def test_since_sequence_and_paging(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    for i in range(10):
        await append(trace_stub, owner, s.id, f"m{i}")
    newer = await _list(trace_stub, owner, s.id, since_sequence=7)
    assert [m.sequence for m in newer.messages] == [8, 9, 10] and newer.total == 3
    newer_all = await _list(trace_stub, owner, s.id, mode=ALL, since_sequence=9)
    assert [m.sequence for m in newer_all.messages] == [10]

    pages, offset = [], 0
    while True:
        page = await _list(trace_stub, owner, s.id, limit=3, offset=offset)
        assert page.total == 10
        if not page.messages:
            break
        pages.append([m.sequence for m in page.messages])
        offset += len(page.messages)
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    again = await _list(trace_stub, owner, s.id, limit=3, offset=3)
    assert [m.sequence for m in again.messages] == [4, 5, 6]


async def test_bad_list_arguments(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    await append(trace_stub, owner, s.id, "only")
    bad = grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(_list(trace_stub, owner, s.id, limit=-1)) == bad
    assert await code_of(_list(trace_stub, owner, s.id, limit=1001)) == bad
    assert await code_of(_list(trace_stub, owner, s.id, offset=-1)) == bad
    assert await code_of(_list(trace_stub, owner, s.id, mode=9)) == bad
    assert await code_of(_list(trace_stub, owner, s.id, head_sequence=42)) == bad
    assert await code_of(_list(trace_stub, "", s.id)) == bad
    assert (await _list(trace_stub, owner, s.id, limit=1000)).total == 1
    head = ts.SetHeadRequest(owner=owner, session_id=s.id, head_sequence=5)
    assert await code_of(trace_stub.SetHead(head)) == bad
    assert await code_of(append(trace_stub, owner, s.id, "x", parent=99)) == bad
    assert await code_of(append(trace_stub, owner, s.id, "x", role=trace_pb2.MESSAGE_ROLE_UNSPECIFIED)) == bad
    assert await code_of(append(trace_stub, owner, s.id, "x", caller_agent="nobody")) == bad


async def test_empty_session_lists_nothing(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    resp = await _list(trace_stub, owner, s.id)
    assert (list(resp.messages), resp.head_sequence, resp.total) == ([], 0, 0)
    trace = await trace_stub.GetTrace(ts.GetTraceRequest(owner=owner, session_id=s.id))
    assert (trace.message_count, trace.main_path_count) == (0, 0)


async def test_message_fields_and_update(trace_stub, unique):
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    meta = struct_pb2.Struct()
    meta.update({"toolCalls": [{"id": "t1"}]})
    placeholder = await append(
        trace_stub,
        owner,
        s.id,
        "",
        ASSISTANT,
        status=trace_pb2.MESSAGE_STATUS_PENDING,
        source=trace_pb2.MESSAGE_SOURCE_A2A,
        a2a_task_id="task-1",
        caller_agent="general",
        caller_session_id="caller-1",
        metadata=meta,
        model="mock-gpt",
    )
    assert placeholder.status == trace_pb2.MESSAGE_STATUS_PENDING
    assert (placeholder.source, placeholder.a2a_task_id) == (trace_pb2.MESSAGE_SOURCE_A2A, "task-1")
    assert (placeholder.caller_agent, placeholder.caller_session_id) == ("general", "caller-1")
    assert placeholder.metadata["toolCalls"][0]["id"] == "t1"
    plain = await append(trace_stub, owner, s.id, "hi")
    assert (plain.source, plain.status) == (trace_pb2.MESSAGE_SOURCE_USER, trace_pb2.MESSAGE_STATUS_COMPLETED)

    change = trace_pb2.Message(
        id=placeholder.id,
        content="done",
        thinking="hmm",
        usage=events_pb2.Usage(input_tokens=3, output_tokens=5),
        status=trace_pb2.MESSAGE_STATUS_COMPLETED,
        model="not in the mask",
    )
    mask = field_mask_pb2.FieldMask(paths=["content", "thinking", "usage", "status"])
    updated = (
        await trace_stub.UpdateMessage(ts.UpdateMessageRequest(owner=owner, message=change, update_mask=mask))
    ).message
    assert (updated.content, updated.thinking, updated.status) == (
        "done",
        "hmm",
        trace_pb2.MESSAGE_STATUS_COMPLETED,
    )
    assert (updated.usage.input_tokens, updated.usage.output_tokens, updated.model) == (3, 5, "mock-gpt")
    stored = (await _list(trace_stub, owner, s.id, mode=ALL)).messages[0]
    assert stored.content == "done" and stored.metadata["toolCalls"][0]["id"] == "t1"

    empty = ts.UpdateMessageRequest(owner=owner, message=change)
    assert await code_of(trace_stub.UpdateMessage(empty)) == grpc.StatusCode.INVALID_ARGUMENT
    unknown = ts.UpdateMessageRequest(
        owner=owner, message=change, update_mask=field_mask_pb2.FieldMask(paths=["role"])
    )
    assert await code_of(trace_stub.UpdateMessage(unknown)) == grpc.StatusCode.INVALID_ARGUMENT


async def test_concurrent_appends_get_distinct_gapless_sequences(trace_stub, trace_backend, unique):
    """50 AppendMessage calls at once on one session: 50 distinct sequences 1..50, one linear chain."""
    owner = f"u-{unique}"
    s = await new_session(trace_stub, owner)
    results = await asyncio.gather(*(append(trace_stub, owner, s.id, f"c{i}") for i in range(50)))
    assert sorted(m.sequence for m in results) == list(range(1, 51))
    assert len({m.id for m in results}) == 50
    trace = await trace_stub.GetTrace(ts.GetTraceRequest(owner=owner, session_id=s.id))
    # Each append took the head of the one before it, so the main path holds all 50.
    assert (trace.session.head_sequence, trace.message_count, trace.main_path_count) == (50, 50, 50)
