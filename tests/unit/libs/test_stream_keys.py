"""Stream keys (libs.ids.parse_stream_key, services.stream.backend.validate_key), property-tested:
every key built by trace_key/a2a_key/subagent_key/push_key parses back, and junk is refused with
InvalidArgument."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.libs.errors import InvalidArgument
from agentmesh.libs.ids import (
    STREAM_KINDS,
    StreamKey,
    a2a_key,
    parse_stream_key,
    push_key,
    subagent_key,
    trace_key,
)
from agentmesh.services.stream.backend import validate_key

BUILDERS = {"trace": trace_key, "a2a": a2a_key, "subagent": subagent_key, "push": push_key}
local_ids = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}", fullmatch=True)
KEY = re.compile(r"(trace|a2a|subagent|push):[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@given(st.sampled_from(STREAM_KINDS), local_ids)
def test_every_built_key_parses_back(kind: str, ident: str) -> None:
    key = BUILDERS[kind](ident)
    assert parse_stream_key(key) == StreamKey(kind, ident)
    assert str(parse_stream_key(key)) == key
    assert validate_key(key) == key


@given(st.text(max_size=120))
def test_junk_is_refused_with_invalid_argument_only(text: str) -> None:
    try:
        parsed = parse_stream_key(text)
    except InvalidArgument as err:
        assert not KEY.fullmatch(text)
        assert "invalid stream key" in err.message and len(err.message) < 250  # the key is cut short
    else:
        assert KEY.fullmatch(text) and str(parsed) == text


@given(
    st.sampled_from(STREAM_KINDS),
    st.text(min_size=1, max_size=80).filter(lambda s: not KEY.fullmatch(f"a2a:{s}")),
)
def test_a_bad_id_is_refused_for_every_kind(kind: str, ident: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_stream_key(f"{kind}:{ident}")


@pytest.mark.parametrize(
    "key",
    [
        "",
        "session",
        "trace:",
        "chat:x",
        "Session:x",
        "trace:x:y",
        "trace:.x",
        "trace:-x",
        "trace:x y",
        "trace:\u00e9",
        "trace:\u0661",  # a non-ASCII digit
        "subagent:" + "x" * 65,
        "a2a:" + "9" * 5000,
        " session:x",
        "trace:x\n",
    ],
)
def test_examples_of_junk(key: str) -> None:
    with pytest.raises(InvalidArgument, match="invalid stream key"):
        parse_stream_key(key)
