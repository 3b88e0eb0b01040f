"""The trace domain's rules, independent of storage: limits, update masks, page tokens and the
allowed status moves. The handlers (services/trace/handlers/) apply them; the stores never do
(docs/design/trace-service.md)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from google.protobuf.descriptor import EnumDescriptor

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import jsonbound
from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import check_local_id, is_local_id
from agentmesh.trace.v1 import trace_pb2 as tp

DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = 50, 200
DEFAULT_LIMIT, MAX_LIMIT = 100, 1000
MAX_PAGE_TOKEN = 512
MAX_TITLE = 500  # characters of a trace's title
MAX_APPENDS = 100  # messages per AppendMessages
MAX_STREAM_APPENDS = 500  # appends per AppendMessageStream request (the append batcher's statement takes 500)
MAX_SUBAGENT_UPDATES = 100  # changes per UpdateSubagentSessions (a delegate batch has at most 10 rows)

FINAL_MESSAGE_STATES = frozenset(
    {tp.MESSAGE_STATUS_COMPLETED, tp.MESSAGE_STATUS_FAILED, tp.MESSAGE_STATUS_CANCELLED}
)
FINAL_TASK_STATES = frozenset(
    {tp.TASK_STATE_COMPLETED, tp.TASK_STATE_CANCELED, tp.TASK_STATE_FAILED, tp.TASK_STATE_REJECTED}
)
# Subagent status moves
# (docs/requirements.md#subagent-rows): queued -> running -> completed | failed | cancelled;
# queued -> failed | cancelled.
SUBAGENT_MOVES: dict[int, frozenset[int]] = {
    ev.SUBAGENT_STATUS_QUEUED: frozenset(
        {ev.SUBAGENT_STATUS_RUNNING, ev.SUBAGENT_STATUS_FAILED, ev.SUBAGENT_STATUS_CANCELLED}
    ),
    ev.SUBAGENT_STATUS_RUNNING: frozenset(
        {ev.SUBAGENT_STATUS_COMPLETED, ev.SUBAGENT_STATUS_FAILED, ev.SUBAGENT_STATUS_CANCELLED}
    ),
    ev.SUBAGENT_STATUS_COMPLETED: frozenset(),
    ev.SUBAGENT_STATUS_FAILED: frozenset(),
    ev.SUBAGENT_STATUS_CANCELLED: frozenset(),
}
TRACE_FIELDS = frozenset({"title", "visible_in_sidebar"})
MESSAGE_FIELDS = frozenset({"content", "thinking", "metadata", "model", "usage", "status"})
SUBAGENT_FIELDS = frozenset(
    {"status", "model", "tool_names", "summary", "result_payload", "error", "token_usage"}
)


# What a run's state is, from its assistant message (trace.proto Run): a pending one runs; a failed
# one whose error is `interrupted` was settled after its process stopped.
RUN_STATE_OF_STATUS: dict[int, int] = {
    tp.MESSAGE_STATUS_PENDING: tp.RUN_STATE_RUNNING,
    tp.MESSAGE_STATUS_COMPLETED: tp.RUN_STATE_DONE,
    tp.MESSAGE_STATUS_FAILED: tp.RUN_STATE_FAILED,
    tp.MESSAGE_STATUS_CANCELLED: tp.RUN_STATE_CANCELLED,
}
INTERRUPTED_CODE = "interrupted"  # the error code of a run whose process stopped (libs/errors.py)


def run_state(status: int, error_code: str) -> int:
    """A run's state from its message's status and its error's code."""
    state = RUN_STATE_OF_STATUS.get(status, tp.RUN_STATE_DONE)  # unset: stored as completed
    if state == tp.RUN_STATE_FAILED and error_code == INTERRUPTED_CODE:
        return tp.RUN_STATE_INTERRUPTED
    return state


def run_kind(source: int, caller_trace_id: str) -> int:
    """What started a run, from its message's provenance: a person (chat), a delegation (subagent), an
    agent-invoke call from a trace of this mesh (callee), or an A2A client (a2a: no caller trace)."""
    if source == tp.MESSAGE_SOURCE_SUBAGENT:
        return tp.RUN_KIND_SUBAGENT
    if source == tp.MESSAGE_SOURCE_A2A:
        return tp.RUN_KIND_CALLEE if caller_trace_id else tp.RUN_KIND_A2A
    return tp.RUN_KIND_CHAT


@dataclass(frozen=True)
class Cursor:
    """Where the previous page ended: the ordering time and the id of its last row (a page token,
    decoded). Stores list the rows after it."""

    time: datetime
    id: str


def need_owner(owner: str) -> None:
    if not owner:
        raise InvalidArgument("an acting user is required")


def need(value: object, name: str) -> None:
    """InvalidArgument `<name> is required` for an empty id."""
    if not value:
        raise InvalidArgument(f"{name} is required")


def need_enum(enum: EnumDescriptor, number: int, name: str) -> None:
    """InvalidArgument `<name> is required` for an enum value that is unset or unknown."""
    if not number or number not in enum.values_by_number:
        raise InvalidArgument(f"{name} is required")


def known(enum: EnumDescriptor, number: int, default: int) -> int:
    """`number`, or `default` when it is unset or unknown (an enum whose unset value means `default`)."""
    return number if number and number in enum.values_by_number else default


TEXT_FIELDS = ("content", "thinking", "model")


def check_text(message: tp.Message, fields: Sequence[str] = TEXT_FIELDS) -> None:
    """No U+0000 in a message's text: PostgreSQL cannot store it, so it is refused on every database
    alike (docs/http-api.md#json-bounds)."""
    for name in fields:
        if "\x00" in getattr(message, name):
            raise InvalidArgument(f"a message's {name} must not contain U+0000")


def check_message(message: tp.Message) -> None:
    """What a message to append needs: who wrote it (source and status default to user and completed)."""
    need_enum(tp.MessageRole.DESCRIPTOR, message.role, "message role")
    check_text(message)
    jsonbound.check_struct(message.metadata)  # the JSON bound of every entry: depth, finite numbers


def check_messages(trace_id: str, messages: Sequence[tp.Message], *, new_trace: bool = False) -> None:
    """Messages to append to `trace_id` together: at least one, each of that trace (or of none). A new
    trace may have no id yet (one is made for it); then its messages name none."""
    if not messages:
        raise InvalidArgument("no messages to append")
    for m in messages:
        if m.trace_id and m.trace_id != trace_id:
            raise InvalidArgument("every message must belong to the trace")
    if new_trace:
        if trace_id:
            check_local_id(trace_id, "trace_id")
    else:
        need(trace_id, "trace_id")
    for m in messages:
        check_message(m)


def check_mask(paths: Sequence[str], allowed: frozenset[str]) -> set[str]:
    """The update_mask paths, checked against the fields an update may change."""
    fields = set(paths)
    if not fields:
        raise InvalidArgument("update_mask is required")
    if unknown := fields - allowed:
        raise InvalidArgument(f"cannot update {', '.join(sorted(unknown))}")
    return fields


def page_size(requested: int) -> int:
    if requested < 0:
        raise InvalidArgument("page_size must not be negative")
    return min(requested or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)


def check_window(limit: int, offset: int, since_sequence: int, head_sequence: int) -> int:
    """Validates a message window; returns the effective limit."""
    if limit < 0 or limit > MAX_LIMIT:
        raise InvalidArgument(f"limit must be 0-{MAX_LIMIT}")
    if offset < 0:
        raise InvalidArgument("offset must not be negative")
    if since_sequence < 0 or head_sequence < 0:
        raise InvalidArgument("sequences must not be negative")
    return limit or DEFAULT_LIMIT


def aware(dt: datetime) -> datetime:
    """SQLite hands timestamps back naive; they are stored in UTC."""
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def encode_page_token(updated_at: datetime, trace_id: str) -> str:
    raw = json.dumps([aware(updated_at).isoformat(), trace_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def cursor(token: str) -> Cursor | None:
    """Where a page token says to go on from (None: the first page); InvalidArgument for a token this
    service did not issue."""
    if not token:
        return None
    time, row_id = decode_page_token(token)
    return Cursor(time, row_id)


def decode_page_token(token: str) -> tuple[datetime, str]:
    """(updated_at, trace id) of the last row of the previous page; InvalidArgument for anything else."""
    if len(token) > MAX_PAGE_TOKEN:  # ours are ~150 characters; bounds the decoding work
        raise InvalidArgument("invalid page_token")
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        stamp, trace_id = json.loads(raw)
        if not isinstance(stamp, str) or not isinstance(trace_id, str) or not is_local_id(trace_id):
            raise TypeError("wrong types")  # an id of ours: no U+0000 or lone surrogate reaches SQL
        return aware(datetime.fromisoformat(stamp)).astimezone(UTC), trace_id  # UTC: may overflow here
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError, OverflowError, RecursionError) as exc:
        raise InvalidArgument("invalid page_token") from exc
