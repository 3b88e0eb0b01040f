"""Messages: appends (one, several of a writer's stream, a batch of finished ones, a turn's two), updates
by mask, reads of a trace's main path or every branch; the rules of services/trace/domain.py, then a
MessageStore. BeginTurn's two messages (a turn's user message and placeholder) are stored here too, with
the ids the turn's owner named (docs/design/turns.md)."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import TypeVar

from agentmesh.libs import events, jsonbound
from agentmesh.libs.errors import InvalidArgument, MeshError
from agentmesh.libs.ids import TraceRef
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import need, need_enum, need_owner
from agentmesh.services.trace.store.base import (
    Append,
    MessagePage,
    MessageQuery,
    MessageStore,
    SubagentStore,
    each_apart,
)
from agentmesh.trace.v1 import message_service_pb2 as ms
from agentmesh.trace.v1 import trace_pb2 as tp

ItemT = TypeVar("ItemT")
MODES = frozenset({ms.PATH_MODE_UNSPECIFIED, ms.PATH_MODE_MAIN_PATH, ms.PATH_MODE_ALL})


def checked(append: Append) -> Append:
    """An append of one message, as append_message takes it."""
    need_owner(append.owner)
    need(append.message.trace_id, "trace_id")
    domain.check_message(append.message)
    return append


OPEN_CARDS = frozenset({"queued", "running"})


def _cards_behind(message: tp.Message) -> bool:
    """The anchor's turn ended, but a card it wrote back still runs: written before its row ended (the
    run learned its end no more, its process or the trace service died)."""
    if message.status == tp.MESSAGE_STATUS_PENDING:
        return False
    # (read with .get: indexing a Struct's fields would add what is missing)
    for batch in message.metadata.fields["subagents"].list_value.values:
        items = batch.struct_value.fields.get("items")
        for item in items.list_value.values if items is not None else ():
            status = item.struct_value.fields.get("status")
            if status is not None and status.string_value in OPEN_CARDS:
                return True
    return False


async def restore_subagents(
    subagents: SubagentStore, owner: str, trace_id: str, messages: Sequence[tp.Message]
) -> None:
    """Rebuilds `metadata.subagents` of the assistant messages that lack it, or whose cards still run
    though their turn ended, from the rows anchored to them (docs/requirements.md#subagent-history-
    restore: the rows are the truth of a subagent's end)."""
    lacking = [
        m
        for m in messages
        if m.role == tp.MESSAGE_ROLE_ASSISTANT and ("subagents" not in m.metadata.fields or _cards_behind(m))
    ]
    if not lacking:
        return
    by_anchor: dict[int, list[tp.SubagentSession]] = defaultdict(list)
    for row in await subagents.list_subagents(owner, trace_id):
        by_anchor[row.parent_message_id].append(row)
    for message in lacking:
        rows = by_anchor.get(message.id)
        if rows:
            # beside what the metadata holds (ParseDict would replace it whole)
            message.metadata.update({"subagents": events.batches_json(rows)})


class MessageHandler:
    def __init__(
        self,
        store: MessageStore,
        subagents: SubagentStore,
    ) -> None:
        self.store = store
        self.subagents = subagents  # for the subagent batches of MESSAGE_VIEW_FULL

    # ---- appends ----------------------------------------------------------------------------------

    async def append(self, owner: str, message: tp.Message, parent_sequence: int | None = None) -> tp.Message:
        """The next message of `message.trace_id`, after the head (or parent_sequence; 0: a root)."""
        checked(Append(owner, message, parent_sequence))
        return await self.store.append_message(owner, message, parent_sequence)

    async def append_each(
        self, items: Sequence[ItemT], append_of: Callable[[ItemT], Append]
    ) -> list[tp.Message | MeshError]:
        """At most MAX_STREAM_APPENDS appends, each as `append` does it and on its own (one that fails,
        in `append_of` too, fails alone), written together: the stored message or the error of each, in
        order."""
        if len(items) > domain.MAX_STREAM_APPENDS:
            raise InvalidArgument(f"at most {domain.MAX_STREAM_APPENDS} appends per request")
        return await each_apart(items, lambda item: checked(append_of(item)), self.store.append_each)

    async def append_finished(
        self, owner: str, trace_id: str, messages: Sequence[tp.Message], parent_sequence: int | None = None
    ) -> list[tp.Message]:
        """Finished messages (completed, failed or cancelled), at most MAX_APPENDS, appended consecutively
        (the first after the head or parent_sequence), all or none. The trace may be a peer's: then they
        are appended at its home, or nowhere."""
        if any(m.status == tp.MESSAGE_STATUS_PENDING for m in messages):
            raise InvalidArgument("appended messages are finished: completed, failed or cancelled")
        if len(messages) > domain.MAX_APPENDS:
            raise InvalidArgument(f"at most {domain.MAX_APPENDS} messages per append")
        return await self._append_messages(owner, trace_id, messages, parent_sequence)

    async def _append_messages(
        self, owner: str, trace_id: str, messages: Sequence[tp.Message], parent_sequence: int | None
    ) -> list[tp.Message]:
        domain.check_messages(trace_id, messages)
        need_owner(owner)
        return await self.store.append_messages(owner, trace_id, messages, parent_sequence)

    async def _create_with_messages(
        self, owner: str, trace: tp.Trace, trace_id: str, messages: Sequence[tp.Message]
    ) -> tuple[tp.Trace, list[tp.Message]]:
        domain.check_messages(trace_id, messages, new_trace=True)
        need_owner(owner)
        return await self.store.create_trace_with_messages(owner, trace, trace_id, messages)

    async def begin_turn(self, owner: str, request: ms.BeginTurnRequest) -> ms.BeginTurnResponse:
        """The turn's user message and placeholder (and its new trace), stored together."""
        out = ms.BeginTurnResponse()
        messages = [request.user_message, request.assistant_message]
        if request.HasField("new_trace"):
            if request.HasField("parent_sequence"):
                raise InvalidArgument("a new trace has no message to follow")
            trace, (user, placeholder) = await self._create_with_messages(
                owner, request.new_trace, request.trace_id, messages
            )
            out.trace.CopyFrom(trace)
        else:
            parent = request.parent_sequence if request.HasField("parent_sequence") else None
            user, placeholder = await self._append_messages(owner, request.trace_id, messages, parent)
        out.user_message.CopyFrom(user)
        out.assistant_message.CopyFrom(placeholder)
        return out

    # ---- changes and reads ------------------------------------------------------------------------

    async def update(self, owner: str, message: tp.Message, paths: Sequence[str]) -> tp.Message:
        """Changes content, thinking, metadata, model, usage and/or status, as the update mask says."""
        fields = domain.check_mask(paths, domain.MESSAGE_FIELDS)
        if "metadata" in fields:
            jsonbound.check_struct(message.metadata)
        domain.check_text(message, [f for f in domain.TEXT_FIELDS if f in fields])
        if "status" in fields:
            need_enum(tp.MessageStatus.DESCRIPTOR, message.status, "message status")
        need_owner(owner)
        return await self.store.update_message(owner, message, fields)

    async def get(self, owner: str, message_id: int) -> tp.Message:
        need_owner(owner)
        return await self.store.get_message(owner, message_id)

    async def list(self, owner: str, query: MessageQuery, view: int = ms.MESSAGE_VIEW_BASIC) -> MessagePage:
        """A page of messages (the window checked; limit 0: the default); in MESSAGE_VIEW_FULL an
        assistant message whose metadata lacks `subagents` gets its batches rebuilt from the rows
        anchored to it (docs/requirements.md#subagent-history-restore)."""
        limit = domain.check_window(query.limit, query.offset, query.since_sequence, query.head_sequence)
        if query.mode not in MODES:
            raise InvalidArgument("unknown list mode")
        need_owner(owner)
        need(query.trace_id, "trace_id")
        page = await self.store.list_messages(owner, dataclasses.replace(query, limit=limit))
        if view == ms.MESSAGE_VIEW_FULL and TraceRef.parse(query.trace_id).is_local:
            await restore_subagents(self.subagents, owner, query.trace_id, page.messages)
        return page
