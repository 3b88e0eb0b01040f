"""services/trace/handlers/traces.py: the rules a trace's writes and pages follow, before and around the
store (a SQLite one)."""

from __future__ import annotations

import pytest

from agentmesh.libs.errors import InvalidArgument, NotFound
from agentmesh.services.trace import domain
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.unit.trace.handlers.conftest import assistant, user


async def test_create_checks_the_id_and_the_owner(traces: TraceHandler, unique: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^trace_id must be 1-64 characters"):
        await traces.create(f"u-{unique}", tp.Trace(agent="general"), "no spaces")
    with pytest.raises(InvalidArgument, match=r"^an acting user is required$"):
        await traces.create("", tp.Trace(agent="general"))
    made = await traces.create(f"u-{unique}", tp.Trace(agent="general"), f"t-{unique}")
    assert (made.id, made.kind, made.owner) == (f"t-{unique}", tp.TRACE_KIND_CHAT, f"u-{unique}")


async def test_get_counts_only_when_asked(
    traces: TraceHandler, messages: MessageHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await traces.create(owner, tp.Trace(agent="general"))
    await messages.append_finished(owner, trace.id, [user("q"), assistant("a")])
    assert (await traces.get(owner, trace.id))[1] == (0, 0)
    assert (await traces.get(owner, trace.id, counts=True))[1] == (2, 2)
    with pytest.raises(InvalidArgument, match=r"^trace_id is required$"):
        await traces.get(owner, "")
    with pytest.raises(NotFound, match=r"^trace not found$"):  # another user's: as a missing one
        await traces.get(f"other-{unique}", trace.id)


async def test_update_takes_the_mask_and_bounds_the_title(traces: TraceHandler, unique: str) -> None:
    owner = f"u-{unique}"
    trace = await traces.create(owner, tp.Trace(agent="general", title="before"))
    with pytest.raises(InvalidArgument, match=r"^update_mask is required$"):
        await traces.update(owner, tp.Trace(id=trace.id, title="x"), [])
    with pytest.raises(InvalidArgument, match=r"^cannot update agent$"):
        await traces.update(owner, tp.Trace(id=trace.id, agent="coder"), ["agent"])
    with pytest.raises(InvalidArgument, match=r"^title is at most 500 characters$"):
        await traces.update(owner, tp.Trace(id=trace.id, title="x" * 501), ["title"])
    assert (await traces.get(owner, trace.id))[0].title == "before"  # nothing was written
    # Only the fields of the mask change.
    changed = await traces.update(owner, tp.Trace(id=trace.id, title="x" * 500, agent="coder"), ["title"])
    assert (changed.title, changed.agent) == ("x" * 500, "general")


async def test_list_pages_with_tokens_it_issued(traces: TraceHandler, unique: str) -> None:
    owner = f"u-{unique}"
    made = [await traces.create(owner, tp.Trace(agent="general", title=f"t{i}")) for i in range(5)]
    await traces.create(owner, tp.Trace(agent="coder", kind=tp.TRACE_KIND_A2A))  # hidden: never listed
    seen, token = [], ""
    while True:
        page, token = await traces.list(owner, 2, token)
        assert len(page) <= 2
        seen += [t.title for t in page]
        if not token:
            break
    assert seen == [t.title for t in reversed(made)]  # most recently active first
    assert (await traces.list(owner, 0, ""))[0][0].title == "t4"  # 0: the default size
    with pytest.raises(InvalidArgument, match=r"^page_size must not be negative$"):
        await traces.list(owner, -1, "")
    with pytest.raises(InvalidArgument, match=r"^invalid page_token$"):
        await traces.list(owner, 2, "not-a-token")


async def test_a_page_size_beyond_the_maximum_is_the_maximum(traces: TraceHandler, unique: str) -> None:
    owner = f"u-{unique}"
    for _ in range(domain.MAX_PAGE_SIZE + 1):
        await traces.create(owner, tp.Trace(agent="general"))
    page, token = await traces.list(owner, 10_000, "")
    assert (len(page), bool(token)) == (domain.MAX_PAGE_SIZE, True)
    rest, last = await traces.list(owner, 10_000, token)
    assert (len(rest), last) == (1, "")


async def test_set_head_needs_a_message_of_the_trace(
    traces: TraceHandler, messages: MessageHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await traces.create(owner, tp.Trace(agent="general"))
    first, _ = await messages.append_finished(owner, trace.id, [user("q"), assistant("a")])
    for head in (0, -1, 3):
        with pytest.raises(InvalidArgument, match=rf"^head_sequence {head} is not in the trace$"):
            await traces.set_head(owner, trace.id, head)
    assert (await traces.set_head(owner, trace.id, first.sequence)).head_sequence == first.sequence


async def test_delete_needs_ids(traces: TraceHandler, unique: str) -> None:
    owner = f"u-{unique}"
    with pytest.raises(InvalidArgument, match=r"^trace_id is required$"):
        await traces.delete(owner, [""])
    trace = await traces.create(owner, tp.Trace(agent="general"))
    assert (await traces.delete(owner, [trace.id])).trace_ids == [trace.id]
