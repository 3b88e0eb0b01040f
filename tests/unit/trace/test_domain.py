"""services/trace/domain.py: page tokens, update masks, message windows, page sizes, status moves."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime, timedelta, timezone

import pytest

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.trace import domain
from agentmesh.trace.v1 import trace_pb2 as tp


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _token(value: object) -> str:
    return _b64(json.dumps(value).encode())


# ---- page tokens -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stamp",
    [
        datetime(2026, 11, 30, 12, 34, 56, 789012, tzinfo=UTC),
        datetime(2026, 11, 30, 12, 34, 56),  # naive, as SQLite hands it back: UTC
        datetime(2026, 11, 30, 14, 34, 56, 1, tzinfo=timezone(timedelta(hours=2))),
        datetime(1, 1, 1, tzinfo=UTC),
        datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
@pytest.mark.parametrize("trace_id", ["t", "0b6f1c9e-3a4d-4e7a-9a51-2f5d3c1e8b7a", "a_b.c-d" * 9 + "x"])
def test_page_token_round_trip(stamp, trace_id):
    token = domain.encode_page_token(stamp, trace_id)
    assert token.isascii() and "=" not in token and len(token) <= domain.MAX_PAGE_TOKEN
    assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")  # URL-safe
    got_stamp, got_id = domain.decode_page_token(token)
    assert got_id == trace_id
    assert got_stamp == (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC))
    assert got_stamp.tzinfo is not None


def test_page_token_of_a_naive_stamp_is_the_utc_one():
    naive = datetime(2026, 1, 2, 3, 4, 5)
    assert domain.encode_page_token(naive, "x") == domain.encode_page_token(naive.replace(tzinfo=UTC), "x")


@pytest.mark.parametrize(
    "token",
    [
        pytest.param("", id="empty"),
        pytest.param("%%%", id="not base64"),
        pytest.param("a", id="bad base64 length"),
        pytest.param("é€", id="not ascii"),
        pytest.param("bm90anNvbg", id="base64 of notjson"),
        pytest.param(_b64(b"\xff\xfe\x00\x01"), id="not utf-8"),
        pytest.param(_b64(b'["2026-01-01T00:00:00+00:00", "x"'), id="truncated json"),
        pytest.param(_token(None), id="null"),
        pytest.param(_token(42), id="number"),
        pytest.param(_token("ab"), id="string of two characters"),
        pytest.param(_token([]), id="empty list"),
        pytest.param(_token(["2026-01-01T00:00:00+00:00"]), id="one item"),
        pytest.param(_token(["2026-01-01T00:00:00+00:00", "x", "y"]), id="three items"),
        pytest.param(_token({"a": "2026-01-01", "b": "x"}), id="object"),
        pytest.param(_token([1_700_000_000, "x"]), id="stamp a number"),
        pytest.param(_token(["2026-01-01T00:00:00+00:00", 7]), id="id a number"),
        pytest.param(_token([None, "x"]), id="stamp null"),
        pytest.param(_token([["2026-01-01"], "x"]), id="stamp a list"),
        pytest.param(_token(["yesterday", "x"]), id="stamp not a date"),
        pytest.param(_token(["2026-13-45T00:00:00", "x"]), id="stamp out of range"),
        pytest.param(_b64(b"[" * 300 + b"]" * 300), id="deeply nested"),
        pytest.param(_b64(b"[" * 100_000), id="too deep to parse"),
        pytest.param("A" * (domain.MAX_PAGE_TOKEN + 1), id="too long"),
    ],
)
def test_page_token_garbage_is_invalid_argument(token):
    with pytest.raises(InvalidArgument) as caught:
        domain.decode_page_token(token)
    assert (caught.value.message, caught.value.reason) == ("invalid page_token", "INVALID_ARGUMENT")


# ---- update masks ------------------------------------------------------------------------------------


def test_check_mask():
    assert domain.check_mask(["title"], domain.TRACE_FIELDS) == {"title"}
    assert domain.check_mask(["title", "visible_in_sidebar", "title"], domain.TRACE_FIELDS) == {
        "title",
        "visible_in_sidebar",
    }
    with pytest.raises(InvalidArgument, match=r"^update_mask is required$"):
        domain.check_mask([], domain.TRACE_FIELDS)
    with pytest.raises(InvalidArgument, match=r"^cannot update kind, owner$"):
        domain.check_mask(["title", "owner", "kind"], domain.TRACE_FIELDS)


@pytest.mark.parametrize(
    ("allowed", "fields", "refused"),
    [
        (
            domain.TRACE_FIELDS,
            {"title", "visible_in_sidebar"},
            {"id", "owner", "kind", "head_sequence", "agent"},
        ),
        (
            domain.MESSAGE_FIELDS,
            {"content", "thinking", "metadata", "model", "usage", "status"},
            {"id", "trace_id", "sequence", "parent_sequence", "role", "source", "create_time"},
        ),
        (
            domain.SUBAGENT_FIELDS,
            {"status", "model", "tool_names", "summary", "result_payload", "error", "token_usage"},
            # start and end times are output only: set by the status moves
            {"start_time", "end_time", "name", "goal", "trace_id", "parent_message_id", "create_time"},
        ),
    ],
)
def test_masks_allow_exactly_the_updatable_fields(allowed, fields, refused):
    assert allowed == fields
    assert domain.check_mask(sorted(fields), allowed) == fields
    for field in refused:
        with pytest.raises(InvalidArgument, match=rf"^cannot update {field}$"):
            domain.check_mask([field], allowed)


# ---- windows and page sizes --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("limit", "offset", "since", "head", "effective"),
    [
        (0, 0, 0, 0, domain.DEFAULT_LIMIT),
        (1, 0, 0, 0, 1),
        (domain.MAX_LIMIT, 5, 3, 9, domain.MAX_LIMIT),
        (7, 2**31 - 1, 2**63 - 1, 2**63 - 1, 7),
    ],
)
def test_check_window_accepts(limit, offset, since, head, effective):
    assert domain.check_window(limit, offset, since, head) == effective


@pytest.mark.parametrize(
    ("limit", "offset", "since", "head", "message"),
    [
        (-1, 0, 0, 0, "limit must be 0-1000"),
        (domain.MAX_LIMIT + 1, 0, 0, 0, "limit must be 0-1000"),
        (0, -1, 0, 0, "offset must not be negative"),
        (0, 0, -1, 0, "sequences must not be negative"),
        (0, 0, 0, -1, "sequences must not be negative"),
    ],
)
def test_check_window_refuses(limit, offset, since, head, message):
    with pytest.raises(InvalidArgument) as caught:
        domain.check_window(limit, offset, since, head)
    assert caught.value.message == message


@pytest.mark.parametrize(
    ("requested", "size"),
    [(0, domain.DEFAULT_PAGE_SIZE), (1, 1), (50, 50), (200, 200), (201, 200), (10_000, domain.MAX_PAGE_SIZE)],
)
def test_page_size(requested, size):
    assert domain.page_size(requested) == size


def test_page_size_refuses_negative():
    with pytest.raises(InvalidArgument, match=r"^page_size must not be negative$"):
        domain.page_size(-1)


def test_need_owner():
    domain.need_owner("alice")
    with pytest.raises(InvalidArgument, match=r"^an acting user is required$"):
        domain.need_owner("")


# ---- status moves ------------------------------------------------------------------------------------


def test_subagent_moves_only_forward():
    q, r, c, f, x = (
        ev.SUBAGENT_STATUS_QUEUED,
        ev.SUBAGENT_STATUS_RUNNING,
        ev.SUBAGENT_STATUS_COMPLETED,
        ev.SUBAGENT_STATUS_FAILED,
        ev.SUBAGENT_STATUS_CANCELLED,
    )
    assert domain.SUBAGENT_MOVES == {q: {r, f, x}, r: {c, f, x}, c: set(), f: set(), x: set()}


def test_final_task_states():
    assert domain.FINAL_TASK_STATES == {
        tp.TASK_STATE_COMPLETED,
        tp.TASK_STATE_CANCELED,
        tp.TASK_STATE_FAILED,
        tp.TASK_STATE_REJECTED,
    }


def test_aware():
    naive = datetime(2026, 1, 1, 8, 0)
    assert domain.aware(naive) == naive.replace(tzinfo=UTC)
    other = datetime(2026, 1, 1, 8, 0, tzinfo=timezone(timedelta(hours=-5)))
    assert domain.aware(other) is other


# ---- required fields and messages to append ----------------------------------------------------------


def test_cursor_of_a_token_and_of_none():
    assert domain.cursor("") is None
    stamp = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
    assert domain.cursor(domain.encode_page_token(stamp, "t-1")) == domain.Cursor(stamp, "t-1")


def test_enums_required_and_defaulted():
    role = tp.MessageRole.DESCRIPTOR
    domain.need_enum(role, tp.MESSAGE_ROLE_USER, "message role")
    for bad in (0, 99):
        with pytest.raises(InvalidArgument, match=r"^message role is required$"):
            domain.need_enum(role, bad, "message role")
    assert domain.known(role, 0, tp.MESSAGE_ROLE_USER) == tp.MESSAGE_ROLE_USER
    assert domain.known(role, 99, tp.MESSAGE_ROLE_USER) == tp.MESSAGE_ROLE_USER
    assert domain.known(role, tp.MESSAGE_ROLE_SYSTEM, tp.MESSAGE_ROLE_USER) == tp.MESSAGE_ROLE_SYSTEM


def test_messages_to_append_together():
    user = tp.Message(role=tp.MESSAGE_ROLE_USER)
    domain.check_messages("t", [user, tp.Message(trace_id="t", role=tp.MESSAGE_ROLE_ASSISTANT)])
    domain.check_messages("", [user], new_trace=True)  # an id is made for it
    for trace_id, messages, new, message in [
        ("t", [], False, "no messages to append"),
        ("t", [tp.Message(trace_id="u", role=tp.MESSAGE_ROLE_USER)], False, "every message must belong"),
        ("", [user], False, "trace_id is required"),
        ("bad id", [user], True, "trace_id must be 1-64 characters"),
        ("t", [user, tp.Message()], False, "message role is required"),
    ]:
        with pytest.raises(InvalidArgument, match=f"^{message}"):
            domain.check_messages(trace_id, messages, new_trace=new)


@pytest.mark.parametrize(
    ("status", "code", "state"),
    [
        (tp.MESSAGE_STATUS_PENDING, "", tp.RUN_STATE_RUNNING),
        (tp.MESSAGE_STATUS_COMPLETED, "", tp.RUN_STATE_DONE),
        (tp.MESSAGE_STATUS_UNSPECIFIED, "", tp.RUN_STATE_DONE),
        (tp.MESSAGE_STATUS_FAILED, "model_error", tp.RUN_STATE_FAILED),
        (tp.MESSAGE_STATUS_FAILED, "interrupted", tp.RUN_STATE_INTERRUPTED),
        (tp.MESSAGE_STATUS_CANCELLED, "cancelled", tp.RUN_STATE_CANCELLED),
        (tp.MESSAGE_STATUS_CANCELLED, "interrupted", tp.RUN_STATE_CANCELLED),
    ],
)
def test_run_state(status, code, state):
    assert domain.run_state(status, code) == state


@pytest.mark.parametrize(
    ("source", "caller_trace", "kind"),
    [
        (tp.MESSAGE_SOURCE_USER, "", tp.RUN_KIND_CHAT),
        (tp.MESSAGE_SOURCE_UNSPECIFIED, "", tp.RUN_KIND_CHAT),
        (tp.MESSAGE_SOURCE_SUBAGENT, "t-1", tp.RUN_KIND_SUBAGENT),
        (tp.MESSAGE_SOURCE_A2A, "t-1", tp.RUN_KIND_CALLEE),
        (tp.MESSAGE_SOURCE_A2A, "", tp.RUN_KIND_A2A),
    ],
)
def test_run_kind(source, caller_trace, kind):
    assert domain.run_kind(source, caller_trace) == kind
