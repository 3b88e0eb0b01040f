"""Redis-backend offsets (services.stream.redis_backend.check_offset), property-tested: every entry id
Redis accepts as an exclusive start passes unchanged; everything else is InvalidArgument (an id Redis
would refuse must never reach it, where it would surface as INTERNAL)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.stream.redis_backend import check_offset

U64 = 2**64 - 1
ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")


def fits(text: str) -> bool:
    return bool(ID.fullmatch(text)) and all(int(p) <= U64 for p in text.split("-")) and text != f"{U64}-{U64}"


entry_ids = st.one_of(
    st.integers(0, U64).map(str),
    st.tuples(st.integers(0, U64), st.integers(0, U64)).map(lambda t: f"{t[0]}-{t[1]}"),
).filter(lambda t: t != f"{U64}-{U64}")


@given(entry_ids)
def test_every_entry_id_passes_unchanged(offset: str) -> None:
    assert check_offset(offset) == offset


def test_empty_is_the_start() -> None:
    assert check_offset("") == ""


@given(st.text(alphabet="0123456789-\u00b2\u0661 x", max_size=45) | st.text(max_size=30))
def test_anything_else_is_invalid_argument(text: str) -> None:
    try:
        assert check_offset(text) == text
    except InvalidArgument as err:
        assert text and not fits(text)
        assert "invalid offset" in err.message and len(err.message) < 200
    else:
        assert text == "" or fits(text)


@pytest.mark.parametrize(
    "text",
    [
        "9" * 5000,
        "\u00b2",
        "1-2-3",
        "1-",
        "-1",
        "9" * 21,
        "9" * 20,  # 20 digits, but above 2^64-1
        str(U64 + 1),
        f"1-{U64 + 1}",
        f"{U64}-{U64}",  # nothing can follow the largest id: Redis refuses it as an exclusive start
        "1700000000000-0\n",
    ],
)
def test_hostile_offsets(text: str) -> None:
    with pytest.raises(InvalidArgument):
        check_offset(text)
