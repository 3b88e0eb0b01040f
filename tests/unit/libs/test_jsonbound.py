"""libs/jsonbound.py: the one JSON bound of every entry (issue 39, point 4)."""

from __future__ import annotations

import json
import math

import pytest
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from agentmesh.libs import jsonbound
from agentmesh.libs.jsonbound import MAX_DEPTH, MAX_INT_DIGITS, BoundError


def nested(levels: int) -> str:
    return "[" * levels + "]" * levels


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (nested(MAX_DEPTH + 1), "nested deeper than 32 levels"),
        (nested(5000), "nested deeper than 32 levels"),  # past Python's recursion limit: no RecursionError
        ("9" * (MAX_INT_DIGITS + 1), "an integer has more than 20 digits"),
        ("-" + "9" * 5000, "an integer has more than 20 digits"),  # past Python's 4,300-digit limit
        ("[NaN]", "NaN is not a JSON number"),
        ('{"a": -Infinity}', "-Infinity is not a JSON number"),
        ("1e400", "the number 1e400 is out of range"),
        ('{"a": ["x\\u0000"]}', "a[0]: must not contain U+0000"),
        ('{"\\u0000": 1}', "a key: must not contain U+0000"),
        ('"\\udc00"', "holds a lone surrogate (not UTF-8)"),
    ],
)
def test_beyond_the_bound(text: str, message: str) -> None:
    with pytest.raises(BoundError) as refused:
        jsonbound.loads(text)
    assert refused.value.message == message
    assert refused.value.http_status == 422


def test_within_the_bound() -> None:
    text = nested(MAX_DEPTH)
    assert jsonbound.loads(text) == json.loads(text)
    assert jsonbound.loads(str(2**64 - 1)) == 2**64 - 1
    assert jsonbound.loads('{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a surrogate pair is fine


def test_not_json_is_left_to_the_caller() -> None:
    with pytest.raises(json.JSONDecodeError):
        jsonbound.loads("{")
    with pytest.raises(UnicodeDecodeError):
        jsonbound.loads(b'{"a": "\xff"}')


def test_the_root_names_the_place() -> None:
    with pytest.raises(BoundError) as refused:
        jsonbound.loads('{"messages": [{"content": "a\\u0000"}]}', root="body")
    assert refused.value.message == "body.messages[0].content: must not contain U+0000"


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=40,
)


def keeps_bound(value: object, depth: int = 0) -> bool:
    if isinstance(value, dict | list):
        items = list(value.items()) if isinstance(value, dict) else [(None, v) for v in value]
        return depth < MAX_DEPTH and all(
            (k is None or "\x00" not in k) and keeps_bound(v, depth + 1) for k, v in items
        )
    if isinstance(value, str):
        return "\x00" not in value
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return abs(value) < 10**MAX_INT_DIGITS
    return True


@settings(max_examples=300, deadline=None)
@given(values)
def test_loads_takes_exactly_what_keeps_the_bound(value: object) -> None:
    text = json.dumps(value)
    if keeps_bound(value):
        assert jsonbound.loads(text) == json.loads(text)
    else:
        with pytest.raises(BoundError):
            jsonbound.loads(text)


def test_check_struct() -> None:
    ok = struct_pb2.Struct()
    ok.update({"a": [1, {"b": 2.5}]})
    jsonbound.check_struct(ok)
    for bad in ({"a": [1, {"b": math.nan}]}, {"a": math.inf}):
        struct = struct_pb2.Struct()
        struct.update(bad)
        with pytest.raises(BoundError, match="not finite"):
            jsonbound.check_struct(struct)
    deep: dict = {}
    for _ in range(MAX_DEPTH + 1):
        deep = {"a": deep}
    struct = struct_pb2.Struct()
    struct.update(deep)
    with pytest.raises(BoundError, match="nested deeper"):
        jsonbound.check_struct(struct)
