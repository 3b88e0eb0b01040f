"""services/trace/handlers/runs.py: the rules of a list of runs (filters, page size, page tokens), before
and around the store: a stand-in that records what reaches it, and the SQL store on SQLite."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import Cursor
from agentmesh.services.trace.handlers.messages import MessageHandler
from agentmesh.services.trace.handlers.runs import RunHandler
from agentmesh.services.trace.handlers.traces import TraceHandler
from agentmesh.services.trace.store.base import RunQuery, RunStore
from agentmesh.services.trace.store.sql import SqlStores
from agentmesh.trace.v1 import trace_pb2 as tp
from tests.unit.trace.handlers.conftest import assistant, user

T0 = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)


class Recorded(RunStore):
    """A store that answers `count` runs, one a second older than the one before, and records each call."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.calls: list[tuple[str, RunQuery, int, Cursor | None]] = []

    async def list_runs(self, owner: str, query: RunQuery, limit: int, after: Cursor | None) -> list[tp.Run]:
        self.calls.append((owner, query, limit, after))
        runs = [tp.Run(message_id=100 - i) for i in range(min(limit, self.count))]
        for i, run in enumerate(runs):
            run.start_time.FromDatetime(T0 - timedelta(seconds=i))
        return runs


@pytest.mark.parametrize(
    ("owner", "query", "page_size", "token", "message"),
    [
        ("", RunQuery(), 0, "", "an acting user is required"),
        ("u", RunQuery(state=42), 0, "", "unknown state 42"),
        ("u", RunQuery(kind=-1), 0, "", "unknown kind -1"),
        ("u", RunQuery(agent="a" * 101), 0, "", "agent is a slug"),
        ("u", RunQuery(agent="a\x00"), 0, "", "agent is a slug"),
        ("u", RunQuery(), -1, "", "page_size must not be negative"),
        ("u", RunQuery(), 0, "garbage", "invalid page_token"),
        ("u", RunQuery(), 0, domain.encode_page_token(T0, "t-1"), "invalid page_token"),  # a trace list's
    ],
)
async def test_bad_requests_never_reach_the_store(owner, query, page_size, token, message) -> None:
    store = Recorded(0)
    with pytest.raises(InvalidArgument, match=message):
        await RunHandler(store).list(owner, query, page_size, token)
    assert store.calls == []


async def test_a_page_asks_one_more_and_its_token_goes_on_after_its_last() -> None:
    store = Recorded(5)
    handler = RunHandler(store)
    query = RunQuery(state=tp.RUN_STATE_RUNNING, kind=tp.RUN_KIND_CHAT, agent="general")
    runs, token = await handler.list("u", query, 2, "")
    assert [r.message_id for r in runs] == [100, 99] and token
    assert store.calls[-1] == ("u", query, 3, None)
    await handler.list("u", query, 2, token)
    assert store.calls[-1][3] == Cursor(T0 - timedelta(seconds=1), "99")
    assert await RunHandler(Recorded(2)).list("u", RunQuery(), 2, "") == (
        [
            tp.Run(message_id=100, start_time=runs[0].start_time),
            tp.Run(message_id=99, start_time=runs[1].start_time),
        ],
        "",
    )
    await handler.list("u", RunQuery(), 0, "")
    assert store.calls[-1][2] == domain.DEFAULT_PAGE_SIZE + 1
    await handler.list("u", RunQuery(), 10_000, "")
    assert store.calls[-1][2] == domain.MAX_PAGE_SIZE + 1


async def test_the_sql_store_lists_a_users_turns(
    stores: SqlStores, traces: TraceHandler, unique: str
) -> None:
    owner = f"u-{unique}"
    trace = await traces.create(owner, tp.Trace(agent="general", title="t"))
    messages = MessageHandler(stores.messages, stores.subagents)
    await messages.append_finished(owner, trace.id, [user("q"), assistant("a")])
    runs, token = await RunHandler(stores.runs).list(owner, RunQuery(), 0, "")
    assert token == "" and [(r.kind, r.state, r.trace_id, r.title) for r in runs] == [
        (tp.RUN_KIND_CHAT, tp.RUN_STATE_DONE, trace.id, "t")
    ]
    assert (await RunHandler(stores.runs).list(f"other-{unique}", RunQuery(), 0, ""))[0] == []
