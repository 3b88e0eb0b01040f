"""Runs: which of them a caller may list, and how (the rules of services/trace/domain.py); a RunStore
keeps them."""

from __future__ import annotations

from datetime import UTC

from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import need_owner
from agentmesh.services.trace.store.base import RunQuery, RunStore
from agentmesh.trace.v1 import trace_pb2 as tp

MAX_AGENT = 100  # characters of the agent filter (a slug, as traces store it)


def _filter(enum: type, number: int, name: str) -> int:
    """An enum filter: 0 (any) or one of its values; InvalidArgument otherwise."""
    if number and number not in enum.DESCRIPTOR.values_by_number:  # type: ignore[attr-defined]
        raise InvalidArgument(f"unknown {name} {number}")
    return number


class RunHandler:
    def __init__(self, store: RunStore) -> None:
        self.store = store

    async def list(
        self, owner: str, query: RunQuery, page_size: int, page_token: str
    ) -> tuple[list[tp.Run], str]:
        """A page of the owner's runs that match `query`, newest first, and the next page's token (""
        on the last)."""
        need_owner(owner)
        _filter(tp.RunState, query.state, "state")
        _filter(tp.RunKind, query.kind, "kind")
        if len(query.agent) > MAX_AGENT or "\x00" in query.agent:
            raise InvalidArgument(f"agent is a slug: at most {MAX_AGENT} characters, no U+0000")
        size = domain.page_size(page_size)
        after = domain.cursor(page_token)
        if after is not None and not after.id.isdigit():
            raise InvalidArgument("invalid page_token")  # a token of another list
        runs = await self.store.list_runs(owner, query, size + 1, after)
        if len(runs) <= size:
            return runs, ""
        last = runs[size - 1]
        return runs[:size], domain.encode_page_token(last.start_time.ToDatetime(UTC), str(last.message_id))
