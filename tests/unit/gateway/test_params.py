"""The patterns the gateway's OpenAPI document states agree with what the gateway checks (hypothesis)."""

from __future__ import annotations

import re
from urllib.parse import urlencode

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from starlette.requests import Request

from agentmesh.gateway.params import MESSAGE_PATTERN, NO_NUL, OFFSET_PATTERN, U64, digits_at_most
from agentmesh.gateway.routes.chat import ChatRequest
from agentmesh.gateway.sse import resume_offset
from agentmesh.libs.errors import InvalidArgument

WHITESPACE = [chr(c) for c in range(0x3001) if chr(c).isspace()]


@given(st.integers(min_value=0, max_value=10**30), st.data())
def test_digits_at_most_matches_exactly_the_values_up_to_n(n: int, data: st.DataObject) -> None:
    pattern = re.compile(digits_at_most(n))
    width = len(str(n))
    value = data.draw(st.integers(min_value=0, max_value=10**width - 1))
    text = str(value).zfill(data.draw(st.integers(min_value=len(str(value)), max_value=width)))
    assert bool(pattern.fullmatch(text)) == (value <= n), (n, text)
    assert not pattern.fullmatch("0" * (width + 1)) and not pattern.fullmatch("")


def request_with(query: bytes = b"", header: bytes | None = None) -> Request:
    headers = [(b"last-event-id", header)] if header is not None else []
    return Request({"type": "http", "method": "GET", "path": "/", "query_string": query, "headers": headers})


offsets = st.one_of(
    st.text(max_size=50),
    st.integers(min_value=0, max_value=2**66).map(str),
    st.tuples(st.integers(0, 2**66), st.integers(0, 2**66)).map(lambda p: f"{p[0]}-{p[1]}"),
    st.tuples(st.sampled_from(["", " ", "\t", "  "]), st.integers(0, 2**65)).map(
        lambda p: f"{p[0]}{p[1]}{p[0]}"
    ),
)


@given(offsets)
def test_resume_offset_takes_exactly_what_the_document_states(offset: str) -> None:
    documented = re.fullmatch(OFFSET_PATTERN, offset) is not None
    try:
        got = resume_offset(request_with(query=urlencode({"lastEventId": offset}).encode()))
    except InvalidArgument as err:
        assert not documented, offset
        assert len(err.message) < 200
        return
    assert documented, offset
    assert got == offset.strip(" \t")
    assert all(part.isascii() and part.isdigit() and int(part) <= U64 for part in got.split("-") if got)


@given(st.text(st.sampled_from([*WHITESPACE, "\x00", "a", "é", "\U0001f600"]), min_size=1, max_size=8))
def test_a_chat_message_is_taken_exactly_when_the_document_says(message: str) -> None:
    documented = re.search(MESSAGE_PATTERN, message) is not None
    try:
        ChatRequest.model_validate({"agent": "general", "message": message})
    except ValidationError:
        assert not documented, repr(message)
    else:
        assert documented, repr(message)


@pytest.mark.parametrize("text", ["a\x00", "\x00", "ok"])
def test_no_nul(text: str) -> None:
    assert (re.search(NO_NUL, text) is not None) == ("\x00" not in text)


# The trace API's id pattern states the shape the parser takes: everything the parser accepts matches
# it, and what it refuses for its shape does not (the rest is refused with a clearer 422).
@given(st.text(alphabet=st.sampled_from("agent:/@[]0123456789.abcXYZ_-"), max_size=40) | st.text(max_size=40))
def test_the_trace_id_pattern_holds_every_id_the_parser_takes(text: str) -> None:
    import re

    from agentmesh.gateway.params import TRACE_ID_PATTERN
    from agentmesh.libs.errors import InvalidArgument
    from agentmesh.libs.ids import TraceRef

    try:
        TraceRef.parse(text)
    except InvalidArgument:
        return
    assert re.fullmatch(TRACE_ID_PATTERN, text), text


def test_the_trace_id_pattern_on_every_form() -> None:
    import re

    from agentmesh.gateway.params import TRACE_ID_PATTERN

    for ok in (
        "abc-123",
        "@terminal-agent-456/abc-123",
        "agent://terminal.local:8000/abc",
        "agent://[::1]:9/x",
    ):
        assert re.fullmatch(TRACE_ID_PATTERN, ok)
    for bad in ("a/b", "agent://u@h/x", "@a/b/c", "agent://h/x?y", ".x"):
        assert not re.fullmatch(TRACE_ID_PATTERN, bad)
