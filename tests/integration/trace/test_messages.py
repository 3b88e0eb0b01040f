"""Messages: sequences, branches (main path vs all), since_sequence, paging, SetTraceHead, GetTrace counts,
updates, and the subagent batches MESSAGE_VIEW_FULL restores."""

from __future__ import annotations

import asyncio

import grpc
from google.protobuf import field_mask_pb2, json_format, struct_pb2

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import identity
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import subagent_service_pb2 as sbs
from agentmesh.trace.v1 import trace_pb2 as tp
from agentmesh.trace.v1 import trace_service_pb2 as ts
from tests.integration.trace.conftest import append, code_of, error_of, new_trace, recent

ASSISTANT = tp.MESSAGE_ROLE_ASSISTANT
MAIN, ALL = ms.PATH_MODE_MAIN_PATH, ms.PATH_MODE_ALL
BAD = grpc.StatusCode.INVALID_ARGUMENT


def _list(stub, owner, trace_id, **kw):
    with identity.acting_as(owner):
        return stub.ListMessages(ms.ListMessagesRequest(trace_id=trace_id, **kw))


async def _full(stub, owner, trace_id):
    with identity.acting_as(owner):
        return await stub.GetTrace(ts.GetTraceRequest(trace_id=trace_id, view=ts.TRACE_VIEW_FULL))


async def test_branches_main_path_and_all(trace_stub, unique, message_stub):
    """Two branches off message 1: each head gives its own chain; mode all gives every message."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    m1 = await append(message_stub, owner, s.id, "q1")
    m2 = await append(message_stub, owner, s.id, "a1", ASSISTANT)
    m3 = await append(message_stub, owner, s.id, "q2")
    m4 = await append(message_stub, owner, s.id, "a2", ASSISTANT)
    # A regenerated answer to q1 branches from m1 (a sibling of m2), then continues.
    b5 = await append(message_stub, owner, s.id, "a1'", ASSISTANT, parent=m1.sequence)
    b6 = await append(message_stub, owner, s.id, "q2'")
    assert [m.sequence for m in (m1, m2, m3, m4, b5, b6)] == [1, 2, 3, 4, 5, 6]
    assert (m1.parent_sequence, m2.parent_sequence, b5.parent_sequence, b6.parent_sequence) == (0, 1, 1, 5)
    assert {m.trace_id for m in (m1, m2, m3, m4, b5, b6)} == {s.id}

    head = await _list(message_stub, owner, s.id)
    assert [m.content for m in head.messages] == ["q1", "a1'", "q2'"]
    assert head.head_sequence == 6 and head.total == 3
    assert list(head.messages) == [m1, b5, b6]  # the stored messages, field for field

    old = await _list(message_stub, owner, s.id, mode=MAIN, head_sequence=4)
    assert [m.sequence for m in old.messages] == [1, 2, 3, 4]
    assert (old.head_sequence, old.total) == (4, 4)

    everything = await _list(message_stub, owner, s.id, mode=ALL)
    assert [m.sequence for m in everything.messages] == [1, 2, 3, 4, 5, 6] and everything.total == 6

    # SetTraceHead switches the branch: the default main path and the next parent follow it.
    with identity.acting_as(owner):
        moved = await trace_stub.SetTraceHead(ts.SetTraceHeadRequest(trace_id=s.id, head_sequence=4))
    assert moved.trace.head_sequence == 4
    assert [m.sequence for m in (await _list(message_stub, owner, s.id)).messages] == [1, 2, 3, 4]
    m7 = await append(message_stub, owner, s.id, "q3")
    assert (m7.sequence, m7.parent_sequence) == (7, 4)

    trace = await _full(trace_stub, owner, s.id)
    assert (trace.message_count, trace.main_path_count, trace.trace.head_sequence) == (7, 5, 7)

    # A new root (parent_sequence 0) starts a disconnected chain.
    root = await append(message_stub, owner, s.id, "fresh", parent=0)
    assert (root.sequence, root.parent_sequence) == (8, 0)
    assert [m.content for m in (await _list(message_stub, owner, s.id)).messages] == ["fresh"]
    trace = await _full(trace_stub, owner, s.id)
    assert (trace.message_count, trace.main_path_count) == (8, 1)


async def test_since_sequence_and_paging(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    for i in range(10):
        await append(message_stub, owner, s.id, f"m{i}")
    newer = await _list(message_stub, owner, s.id, since_sequence=7)
    assert [m.sequence for m in newer.messages] == [8, 9, 10] and newer.total == 3
    newer_all = await _list(message_stub, owner, s.id, mode=ALL, since_sequence=9)
    assert [m.sequence for m in newer_all.messages] == [10] and newer_all.total == 1
    nothing_new = await _list(message_stub, owner, s.id, since_sequence=10)
    assert (list(nothing_new.messages), nothing_new.total, nothing_new.head_sequence) == ([], 0, 10)

    pages, offset = [], 0
    while True:
        page = await _list(message_stub, owner, s.id, limit=3, offset=offset)
        assert page.total == 10
        if not page.messages:
            break
        pages.append([m.sequence for m in page.messages])
        offset += len(page.messages)
    assert pages == [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10]]
    again = await _list(message_stub, owner, s.id, limit=3, offset=3)
    assert [m.sequence for m in again.messages] == [4, 5, 6]
    assert len((await _list(message_stub, owner, s.id, limit=0)).messages) == 10  # 0: the default (100)


async def test_bad_list_arguments(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(message_stub, owner, s.id, "only")
    for kw in (
        {"limit": -1},
        {"limit": 1001},
        {"offset": -1},
        {"since_sequence": -1},
        {"head_sequence": -1},
        {"mode": 9},
        {"head_sequence": 42},
        {"head_sequence": 42, "mode": ALL},
    ):
        assert await code_of(_list(message_stub, owner, s.id, **kw)) == BAD, kw
    assert await code_of(_list(message_stub, owner, "")) == BAD
    # The mesh's own principal (no user) is not a user: UNAUTHENTICATED, not a lookup.
    error = await error_of(message_stub.ListMessages(ms.ListMessagesRequest(trace_id=s.id)))
    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (await _list(message_stub, owner, s.id, limit=1000)).total == 1
    with identity.acting_as(owner):
        for head in (5, 0, -1):
            request = ts.SetTraceHeadRequest(trace_id=s.id, head_sequence=head)
            assert await code_of(trace_stub.SetTraceHead(request)) == BAD, head
    assert await code_of(append(message_stub, owner, s.id, "x", parent=99)) == BAD
    assert await code_of(append(message_stub, owner, s.id, "x", role=tp.MESSAGE_ROLE_UNSPECIFIED)) == BAD
    assert await code_of(append(message_stub, owner, "", "x")) == BAD
    # Nothing of the refused appends was stored.
    assert (await _full(trace_stub, owner, s.id)).message_count == 1
    # caller_agent is provenance: a run whose agent was deleted meanwhile still writes, unlinked (what
    # the deletion's ON DELETE SET NULL leaves in the rows written before it).
    unlinked = await append(message_stub, owner, s.id, "x", caller_agent="nobody")
    assert unlinked.caller_agent == ""


async def test_empty_trace_lists_nothing(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    resp = await _list(message_stub, owner, s.id)
    assert (list(resp.messages), resp.head_sequence, resp.total) == ([], 0, 0)
    every = await _list(message_stub, owner, s.id, mode=ALL)
    assert (list(every.messages), every.head_sequence, every.total) == ([], 0, 0)
    trace = await _full(trace_stub, owner, s.id)
    assert (trace.message_count, trace.main_path_count) == (0, 0)


async def test_message_fields_and_update(trace_stub, unique, message_stub):
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    meta = struct_pb2.Struct()
    meta.update({"toolCalls": [{"id": "t1"}]})
    placeholder = await append(
        message_stub,
        owner,
        s.id,
        "",
        ASSISTANT,
        status=tp.MESSAGE_STATUS_PENDING,
        source=tp.MESSAGE_SOURCE_A2A,
        a2a_task_id="task-1",
        caller_agent="general",
        caller_trace_id="caller-1",
        metadata=meta,
        model="mock-gpt",
        thinking="first thoughts",
        usage=ev.Usage(input_tokens=1, output_tokens=2),
    )
    assert (placeholder.trace_id, placeholder.sequence, placeholder.role) == (s.id, 1, ASSISTANT)
    assert placeholder.status == tp.MESSAGE_STATUS_PENDING
    assert (placeholder.source, placeholder.a2a_task_id) == (tp.MESSAGE_SOURCE_A2A, "task-1")
    assert (placeholder.caller_agent, placeholder.caller_trace_id) == ("general", "caller-1")
    assert placeholder.metadata == meta and (placeholder.model, placeholder.thinking) == (
        "mock-gpt",
        "first thoughts",
    )
    assert placeholder.usage == ev.Usage(input_tokens=1, output_tokens=2)
    assert recent(placeholder.create_time)
    plain = await append(message_stub, owner, s.id, "hi")
    assert (plain.source, plain.status, plain.role) == (
        tp.MESSAGE_SOURCE_USER,
        tp.MESSAGE_STATUS_COMPLETED,
        tp.MESSAGE_ROLE_USER,
    )
    assert (plain.a2a_task_id, plain.caller_agent, plain.caller_trace_id) == ("", "", "")
    assert not plain.HasField("metadata")

    change = tp.Message(
        id=placeholder.id,
        content="done",
        thinking="hmm",
        usage=ev.Usage(input_tokens=3, output_tokens=5),
        status=tp.MESSAGE_STATUS_COMPLETED,
        model="not in the mask",
    )
    mask = field_mask_pb2.FieldMask(paths=["content", "thinking", "usage", "status"])
    with identity.acting_as(owner):
        updated = (
            await message_stub.UpdateMessage(ms.UpdateMessageRequest(message=change, update_mask=mask))
        ).message
        assert (updated.content, updated.thinking, updated.status) == (
            "done",
            "hmm",
            tp.MESSAGE_STATUS_COMPLETED,
        )
        assert (updated.usage.input_tokens, updated.usage.output_tokens, updated.model) == (3, 5, "mock-gpt")
        assert updated.metadata == meta
        got = (await message_stub.GetMessage(ms.GetMessageRequest(message_id=placeholder.id))).message
        assert got == updated
        stored = (await _list(message_stub, owner, s.id, mode=ALL)).messages[0]
        assert stored == updated

        # Metadata and model change only through the mask; a cleared metadata is unset.
        clear = tp.Message(id=placeholder.id, model="other-model")
        cleared = (
            await message_stub.UpdateMessage(
                ms.UpdateMessageRequest(message=clear, update_mask={"paths": ["metadata", "model"]})
            )
        ).message
        assert not cleared.HasField("metadata") and cleared.model == "other-model"

        for paths in ([], ["role"], ["sequence"], ["content", "trace_id"]):
            bad = ms.UpdateMessageRequest(message=change, update_mask={"paths": paths})
            assert await code_of(message_stub.UpdateMessage(bad)) == BAD, paths
        unset_status = ms.UpdateMessageRequest(
            message=tp.Message(id=plain.id), update_mask={"paths": ["status"]}
        )
        assert await code_of(message_stub.UpdateMessage(unset_status)) == BAD
        missing = await error_of(message_stub.GetMessage(ms.GetMessageRequest(message_id=987_654_321)))
        assert (missing.code(), missing.details()) == (grpc.StatusCode.NOT_FOUND, "message not found")


async def test_full_view_restores_subagent_batches(trace_stub, unique, subagent_stub, message_stub):
    """An assistant message whose metadata lacks `subagents` gets its batches rebuilt from the rows
    anchored to it in MESSAGE_VIEW_FULL (a turn that died before writing them back); BASIC does not."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    await append(message_stub, owner, s.id, "split")
    lost = await append(message_stub, owner, s.id, "", ASSISTANT)
    kept_meta = struct_pb2.Struct()
    kept_meta.update({"subagents": [{"title": "written back"}]})
    kept = await append(message_stub, owner, s.id, "", ASSISTANT, metadata=kept_meta)
    with identity.acting_as(owner):
        rows = (
            await subagent_stub.CreateSubagentSessions(
                sbs.CreateSubagentSessionsRequest(
                    subagents=[
                        tp.SubagentSession(
                            trace_id=s.id,
                            parent_message_id=anchor.id,
                            parent_tool_call_id="call-1",
                            name=f"n{i}",
                            goal=f"g{i}",
                            sort_order=i,
                            batch_title="two parts",
                        )
                        for anchor in (lost, kept)
                        for i in (1, 0)
                    ]
                )
            )
        ).subagents
    basic = await _list(message_stub, owner, s.id, mode=ALL)
    assert "subagents" not in basic.messages[1].metadata.fields
    full = (await _list(message_stub, owner, s.id, mode=ALL, view=ms.MESSAGE_VIEW_FULL)).messages
    assert "subagents" not in full[0].metadata.fields  # a user message is left alone
    assert full[2].metadata == kept_meta  # metadata written back wins
    (batch,) = json_format.MessageToDict(full[1].metadata)["subagents"]
    assert (batch["parentMessageId"], batch["title"], batch["toolCallId"]) == (lost.id, "two parts", "call-1")
    assert [(item["id"], item["name"], item["status"]) for item in batch["items"]] == [
        (rows[1].id, "n0", "queued"),
        (rows[0].id, "n1", "queued"),
    ]
    assert batch["summary"] == {"total": 2, "completed": 0, "running": 2, "failed": 0, "cancelled": 0}


async def test_concurrent_appends_get_distinct_gapless_sequences(trace_stub, unique, message_stub):
    """50 appends at once on one trace (each on a stream of its own): 50 distinct sequences 1..50, one
    linear chain."""
    owner = f"u-{unique}"
    s = await new_trace(trace_stub, owner)
    results = await asyncio.gather(*(append(message_stub, owner, s.id, f"c{i}") for i in range(50)))
    assert sorted(m.sequence for m in results) == list(range(1, 51))
    assert len({m.id for m in results}) == 50
    trace = await _full(trace_stub, owner, s.id)
    # Each append took the head of the one before it, so the main path holds all 50.
    assert (trace.trace.head_sequence, trace.message_count, trace.main_path_count) == (50, 50, 50)
