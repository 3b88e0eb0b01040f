"""Subagents (docs/requirements.md#subagent-rows): how a batch's rows begin, which fields a change may
set and the status moves (queued -> running -> completed | failed | cancelled; queued -> failed |
cancelled), with the start and end times those moves set; a SubagentStore keeps them."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import FailedPrecondition, InvalidArgument
from agentmesh.libs.protojson import enum_to_str
from agentmesh.services.trace import domain
from agentmesh.services.trace.domain import need, need_enum, need_owner
from agentmesh.services.trace.store.base import SubagentChange, SubagentStore
from agentmesh.trace.v1 import trace_pb2 as tp

STATUS, SOURCE = ev.SubagentStatus.DESCRIPTOR, ev.SubagentSource.DESCRIPTOR
BEGINS = frozenset({ev.SUBAGENT_STATUS_QUEUED, ev.SUBAGENT_STATUS_FAILED})  # failed: with its error


def change_of(update: tp.SubagentSession, fields: set[str]) -> SubagentChange:
    """The change an update makes to a row: the fields of its mask; a status only forward, moving to
    running sets the start time and to a final status the end time (each once)."""

    def change(current: tp.SubagentSession, at: datetime) -> tp.SubagentSession:
        new = tp.SubagentSession()
        new.CopyFrom(current)
        if "status" in fields and update.status != current.status:
            if update.status not in domain.SUBAGENT_MOVES[current.status]:
                old, to = enum_to_str(STATUS, current.status), enum_to_str(STATUS, update.status)
                raise FailedPrecondition(f"subagent cannot go from {old} to {to}")
            new.status = update.status
            if update.status == ev.SUBAGENT_STATUS_RUNNING and not new.HasField("start_time"):
                new.start_time.FromDatetime(at)
            if not domain.SUBAGENT_MOVES[update.status] and not new.HasField("end_time"):
                new.end_time.FromDatetime(at)
        if "model" in fields:
            new.model = update.model
        if "tool_names" in fields:
            new.tool_names[:] = update.tool_names
        if "summary" in fields:
            new.summary = update.summary
        if "error" in fields:
            new.error = update.error
        for message in ("result_payload", "token_usage"):
            if message in fields:
                new.ClearField(message)  # type: ignore[arg-type]
                if update.HasField(message):  # type: ignore[arg-type]
                    getattr(new, message).CopyFrom(getattr(update, message))
        return new

    return change


class SubagentHandler:
    def __init__(self, store: SubagentStore) -> None:
        self.store = store

    async def create(
        self,
        owner: str,
        rows: Sequence[tp.SubagentSession],
        turns: Sequence[tuple[tp.Message, tp.Message]] = (),
    ) -> tuple[list[tp.SubagentSession], list[tuple[tp.Message, tp.Message]]]:
        """The rows of one delegate batch, each with its hidden trace, in one transaction: queued (or
        failed, with its error), a preset agent's or a clone; with `turns` (one per row), each hidden
        trace begins with its turn's user message and placeholder."""
        if not rows:
            return [], []
        if turns and len(turns) != len(rows):
            raise InvalidArgument("give one turn per subagent, or none")
        need_owner(owner)
        begun = []
        for row in rows:
            need(row.trace_id, "trace_id")
            new = tp.SubagentSession()
            new.CopyFrom(row)
            preset_or_clone = ev.SUBAGENT_SOURCE_PRESET if row.preset_agent else ev.SUBAGENT_SOURCE_CLONE
            new.source_type = domain.known(SOURCE, row.source_type, preset_or_clone)  # type: ignore[assignment]
            new.status = domain.known(STATUS, row.status, ev.SUBAGENT_STATUS_QUEUED)  # type: ignore[assignment]
            if new.status not in BEGINS:
                raise InvalidArgument("a subagent starts queued (or failed, with its error)")
            begun.append(new)
        for user, placeholder in turns:
            domain.check_message(user)
            domain.check_message(placeholder)
        return await self.store.create_subagents(owner, begun, turns)

    async def update(self, owner: str, row: tp.SubagentSession, paths: Sequence[str]) -> tp.SubagentSession:
        """Changes the fields of the update mask (status, model, tool_names, summary, result_payload,
        error, token_usage); the status moves only forward."""
        return (await self.update_many(owner, [(row, paths)]))[0]

    async def update_many(
        self, owner: str, updates: Sequence[tuple[tp.SubagentSession, Sequence[str]]]
    ) -> list[tp.SubagentSession]:
        """At most MAX_SUBAGENT_UPDATES changes (row, mask), each as `update`, in order, all or none."""
        if len(updates) > domain.MAX_SUBAGENT_UPDATES:
            raise InvalidArgument(f"at most {domain.MAX_SUBAGENT_UPDATES} subagent changes per call")
        masks = [domain.check_mask(paths, domain.SUBAGENT_FIELDS) for _, paths in updates]
        need_owner(owner)
        for (row, _), fields in zip(updates, masks, strict=True):
            if "status" in fields:
                need_enum(STATUS, row.status, "status")
        changes = [(row.id, change_of(row, fields)) for (row, _), fields in zip(updates, masks, strict=True)]
        return await self.store.update_subagents(owner, changes)

    async def get(self, owner: str, subagent_id: str) -> tp.SubagentSession:
        need_owner(owner)
        return await self.store.get_subagent(owner, subagent_id)

    async def list(self, owner: str, trace_id: str, parent_message_id: int = 0) -> list[tp.SubagentSession]:
        """One anchor's rows (0: every anchor of the trace), by anchor and sort order."""
        need_owner(owner)
        need(trace_id, "trace_id")
        return await self.store.list_subagents(owner, trace_id, parent_message_id)
