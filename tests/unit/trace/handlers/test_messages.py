"""services/trace/handlers/messages.py: what an append, a change and a read of messages must be, checked
before the store (a SQLite one, or one that records what reaches it)."""

from __future__ import annotations

from typing import Any

import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import InvalidArgument, MeshError, NotFound
from agentmesh.services.trace import domain
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.subagents import SubagentHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.base import Append, MessagePage, MessageQuery
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.unit.trace.handlers.conftest import assistant, user


class Recording:
    """A MessageStore stand-in for what must never reach a store: every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any) -> Any:
            self.calls.append((name, args))
            return MessagePage([], 0, 0)

        return call


@pytest.fixture
def recording(stores: SqlStores) -> tuple[MessageHandler, Recording]:
    store = Recording()
    return MessageHandler(store, stores.subagents), store  # type: ignore[arg-type]


async def _trace(traces: TraceHandler, owner: str) -> tp.Trace:
    return await traces.create(owner, tp.Trace(agent="general"))


async def test_an_append_needs_its_trace_and_role(
    recording: tuple[MessageHandler, Recording], unique: str
) -> None:
    handler, store = recording
    with pytest.raises(InvalidArgument, match=r"^trace_id is required$"):
        await handler.append(f"u-{unique}", user("x"))
    with pytest.raises(InvalidArgument, match=r"^message role is required$"):
        await handler.append(f"u-{unique}", tp.Message(trace_id="t", content="x"))
    with pytest.raises(InvalidArgument, match=r"^message role is required$"):
        await handler.append(f"u-{unique}", tp.Message(trace_id="t", role=99, content="x"))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match=r"^an acting user is required$"):
        await handler.append("", user("x", trace_id="t"))
    assert store.calls == []


async def test_appended_messages_are_finished_few_and_of_the_trace(
    recording: tuple[MessageHandler, Recording], unique: str
) -> None:
    handler, store = recording
    owner = f"u-{unique}"
    cases = [
        ([assistant(status=tp.MESSAGE_STATUS_PENDING)], "appended messages are finished"),
        ([user("x")] * (domain.MAX_APPENDS + 1), f"at most {domain.MAX_APPENDS} messages per append"),
        ([], "no messages to append"),
        ([user("x", trace_id="elsewhere")], "every message must belong to the trace"),
        ([user("x"), tp.Message(content="no role")], "message role is required"),
    ]
    for batch, message in cases:
        with pytest.raises(InvalidArgument, match=f"^{message}"):
            await handler.append_finished(owner, "t", batch)
    with pytest.raises(InvalidArgument, match=r"^trace_id is required$"):
        await handler.append_finished(owner, "", [user("x")])
    assert store.calls == []


async def test_each_append_of_a_stream_fails_alone(
    traces: TraceHandler, messages: MessageHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await _trace(traces, owner)

    def append_of(item: tuple[str, tp.Message]) -> Append:
        who, message = item
        if who == "forged":
            raise InvalidArgument("not verified")
        return Append(who, message)

    items = [
        (owner, user("one", trace_id=trace.id)),
        ("forged", user("two", trace_id=trace.id)),
        (owner, tp.Message(trace_id=trace.id, content="no role")),
        (f"other-{unique}", user("not theirs", trace_id=trace.id)),
        (owner, user("three", trace_id=trace.id)),
    ]
    out = await messages.append_each(items, append_of)
    assert [m.content if isinstance(m, tp.Message) else m.message for m in out] == [
        "one",
        "not verified",
        "message role is required",
        "trace not found",
        "three",
    ]
    assert [m.sequence for m in out if not isinstance(m, MeshError)] == [1, 2]
    with pytest.raises(InvalidArgument, match=rf"^at most {domain.MAX_STREAM_APPENDS} appends per request$"):
        await messages.append_each([items[0]] * (domain.MAX_STREAM_APPENDS + 1), append_of)


async def test_an_update_takes_the_mask_and_a_status_only_when_set(
    traces: TraceHandler, messages: MessageHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await _trace(traces, owner)
    (placeholder,) = await messages.append_finished(owner, trace.id, [assistant("partial")])
    with pytest.raises(InvalidArgument, match=r"^cannot update role$"):
        await messages.update(owner, tp.Message(id=placeholder.id, role=tp.MESSAGE_ROLE_USER), ["role"])
    with pytest.raises(InvalidArgument, match=r"^message status is required$"):
        await messages.update(owner, tp.Message(id=placeholder.id), ["status"])
    changed = await messages.update(
        owner, tp.Message(id=placeholder.id, content="done", model="m"), ["content"]
    )
    assert (changed.content, changed.model) == ("done", "")
    with pytest.raises(NotFound, match=r"^message not found$"):
        await messages.update(f"other-{unique}", tp.Message(id=placeholder.id, content="x"), ["content"])


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (MessageQuery("t", limit=domain.MAX_LIMIT + 1), "limit must be 0-1000"),
        (MessageQuery("t", offset=-1), "offset must not be negative"),
        (MessageQuery("t", since_sequence=-1), "sequences must not be negative"),
        (MessageQuery("t", mode=7), "unknown list mode"),
        (MessageQuery(""), "trace_id is required"),
    ],
)
async def test_a_read_outside_the_window_is_refused_before_the_store(
    recording: tuple[MessageHandler, Recording], query: MessageQuery, message: str
) -> None:
    handler, store = recording
    with pytest.raises(InvalidArgument, match=f"^{message}$"):
        await handler.list("alice", query)
    assert store.calls == []


async def test_a_read_reaches_the_store_with_its_effective_limit(
    recording: tuple[MessageHandler, Recording],
) -> None:
    handler, store = recording
    await handler.list("alice", MessageQuery("t", mode=ms.PATH_MODE_ALL))
    ((name, (owner, query)),) = store.calls
    assert (name, owner, query.limit, query.mode) == ("list_messages", "alice", domain.DEFAULT_LIMIT, 2)


async def test_the_full_view_restores_subagent_batches(
    traces: TraceHandler, messages: MessageHandler, subagents: SubagentHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await _trace(traces, owner)
    _, anchor = await messages.append_finished(owner, trace.id, [user("split"), assistant("")])
    await subagents.create(
        owner,
        [
            tp.SubagentSession(
                trace_id=trace.id, parent_message_id=anchor.id, name="a", goal="g", batch_title="b"
            )
        ],
    )
    basic = await messages.list(owner, MessageQuery(trace.id))
    full = await messages.list(owner, MessageQuery(trace.id), ms.MESSAGE_VIEW_FULL)
    assert "subagents" not in basic.messages[1].metadata.fields
    (batch,) = full.messages[1].metadata.fields["subagents"].list_value.values
    assert batch.struct_value.fields["title"].string_value == "b"
    (card,) = batch.struct_value.fields["items"].list_value.values
    assert card.struct_value.fields["name"].string_value == "a"


async def test_the_full_view_shows_a_card_that_ended_after_its_turn_wrote_it_back(
    traces: TraceHandler, messages: MessageHandler, subagents: SubagentHandler, unique: str
) -> None:
    """The turn ended with a card still running in its metadata (it learned the subagent's end no more:
    its process or the trace service died), and the row ended later: the full view shows the row's end;
    an unfinished turn's cards are left as written."""
    owner = f"u-{unique}"
    trace = await _trace(traces, owner)
    _, anchor = await messages.append_finished(owner, trace.id, [user("split"), assistant("")])
    (row,), _ = await subagents.create(
        owner,
        [
            tp.SubagentSession(
                trace_id=trace.id, parent_message_id=anchor.id, name="a", goal="g", batch_title="b"
            )
        ],
    )
    stale = {"title": "b", "items": [{"id": row.id, "name": "a", "status": "running"}]}
    anchor.metadata.update({"subagents": [stale]})
    await messages.update(owner, anchor, ["metadata"])
    for step in (ev.SUBAGENT_STATUS_RUNNING, ev.SUBAGENT_STATUS_COMPLETED):
        row.status = step
        await subagents.update(owner, row, ["status"])

    def status(page: MessagePage) -> str:
        (batch,) = page.messages[1].metadata.fields["subagents"].list_value.values
        (card,) = batch.struct_value.fields["items"].list_value.values
        return card.struct_value.fields["status"].string_value

    assert status(await messages.list(owner, MessageQuery(trace.id))) == "running"  # as stored
    assert status(await messages.list(owner, MessageQuery(trace.id), ms.MESSAGE_VIEW_FULL)) == "completed"
    anchor.status = tp.MESSAGE_STATUS_PENDING
    await messages.update(owner, anchor, ["status"])
    assert status(await messages.list(owner, MessageQuery(trace.id), ms.MESSAGE_VIEW_FULL)) == "running"
