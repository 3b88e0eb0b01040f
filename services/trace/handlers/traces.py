"""Traces: what a caller may create, read, list, change and delete, and how (the rules of
services/trace/domain.py); a TraceStore keeps them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC

from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import check_local_id
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import need, need_owner
from agentmesh.services.trace.store.base import Deleted, TraceStore
from agentmesh.trace.v1 import trace_pb2 as tp


class TraceHandler:
    def __init__(self, store: TraceStore) -> None:
        self.store = store

    async def create(self, owner: str, trace: tp.Trace, trace_id: str = "") -> tp.Trace:
        """A trace of `owner`'s (its agent, kind, title, visible_in_sidebar), under `trace_id` (a local id)
        or a new random one."""
        need_owner(owner)
        if trace_id:
            check_local_id(trace_id, "trace_id")
        return await self.store.create_trace(owner, trace, trace_id)

    async def get(
        self, owner: str, trace_id: str, *, counts: bool = False
    ) -> tuple[tp.Trace, tuple[int, int]]:
        """The trace, and with `counts` its (messages in every branch, messages on the main path)."""
        need_owner(owner)
        need(trace_id, "trace_id")
        trace = await self.store.get_trace(owner, trace_id)
        return trace, (await self.store.count_messages(owner, trace_id) if counts else (0, 0))

    async def list(self, owner: str, page_size: int, page_token: str) -> tuple[list[tp.Trace], str]:
        """A page of the owner's listed traces, most recently active first, and the next page's token
        ("" on the last)."""
        need_owner(owner)
        size = domain.page_size(page_size)
        traces = await self.store.list_traces(owner, size + 1, domain.cursor(page_token))
        if len(traces) <= size:
            return traces, ""
        last = traces[size - 1]
        return traces[:size], domain.encode_page_token(last.update_time.ToDatetime(UTC), last.id)

    async def update(self, owner: str, trace: tp.Trace, paths: Sequence[str]) -> tp.Trace:
        """Changes the title and/or visible_in_sidebar, as the update mask says."""
        fields = domain.check_mask(paths, domain.TRACE_FIELDS)
        if "title" in fields and len(trace.title) > domain.MAX_TITLE:
            raise InvalidArgument(f"title is at most {domain.MAX_TITLE} characters")
        need_owner(owner)
        need(trace.id, "trace_id")
        return await self.store.update_trace(owner, trace, fields)

    async def delete(self, owner: str, trace_ids: Sequence[str] | None) -> Deleted:
        """Deletes the traces (None: every trace of the owner) and everything under them."""
        need_owner(owner)
        for trace_id in trace_ids or ():
            need(trace_id, "trace_id")
        return await self.store.delete_traces(owner, trace_ids)

    async def set_head(self, owner: str, trace_id: str, head_sequence: int) -> tp.Trace:
        """Moves the head to an existing message (switches branch)."""
        need_owner(owner)
        need(trace_id, "trace_id")
        if head_sequence <= 0:
            raise InvalidArgument(f"head_sequence {head_sequence} is not in the trace")
        return await self.store.set_head(owner, trace_id, head_sequence)
