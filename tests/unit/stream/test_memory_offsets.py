"""Memory-backend offsets (services.stream.memory.parse_offset / format_offset), property-tested, and
a hostile offset at the backend itself: always InvalidArgument, never another exception."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.libs import events
from agentmesh.libs.errors import InvalidArgument, NotFound
from agentmesh.services.stream.memory import MemoryBackend, format_offset, parse_offset

MAX = 10**20 - 1  # 20 digits


@given(st.integers(0, MAX))
def test_format_then_parse_round_trips(n: int) -> None:
    text = format_offset(n)
    assert len(text) == 20 and text.isascii() and text.isdigit()
    assert parse_offset(text) == n


@given(st.integers(0, MAX), st.integers(0, MAX))
def test_string_order_is_number_order(a: int, b: int) -> None:
    assert (format_offset(a) < format_offset(b)) == (a < b)


@given(st.from_regex(r"[0-9]{1,20}", fullmatch=True))
def test_any_one_to_twenty_ascii_digits_parse(text: str) -> None:
    assert parse_offset(text) == int(text)


def test_empty_is_the_start() -> None:
    assert parse_offset("") == 0


@given(st.text(max_size=30))
def test_anything_else_is_invalid_argument(text: str) -> None:
    try:
        n = parse_offset(text)
    except InvalidArgument as err:
        assert not (text.isascii() and text.isdigit() and len(text) <= 20) or text == ""
        assert "invalid offset" in err.message
    else:
        assert text == "" or (text.isascii() and text.isdigit() and len(text) <= 20 and n == int(text))


@pytest.mark.parametrize(
    "text",
    [
        "9" * 5000,
        "9" * 21,
        "\u00b2",
        "\u0661\u0662",
        "\uff11",
        "1-2-3",
        "1-0",
        "-1",
        "+1",
        " 1",
        "1 ",
        "1_000",
        "0x1",
    ],
)
def test_hostile_offsets(text: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        parse_offset(text)
    assert len(err.value.message) < 120  # never the whole input


@pytest.mark.parametrize("offset", ["9" * 5000, "\u00b2", "1-2-3"])
async def test_the_backend_refuses_a_hostile_offset(offset: str) -> None:
    backend = MemoryBackend()
    await backend.create("trace:x", "alice")
    await backend.append("trace:x", [events.text_delta("a")])
    with pytest.raises(InvalidArgument):
        async for _ in backend.subscribe("trace:x", offset, "alice", idle_timeout_ms=50):
            pass
    assert backend.subscribers == 0


async def test_offsets_are_per_buffer_and_reveal_no_other_buffers_activity() -> None:
    """A reader of one buffer learns nothing of the others from its offsets: writes to one do not move
    the offsets of another, which count its own events from its base."""
    backend = MemoryBackend()
    await backend.create("trace:mine", "alice")
    await backend.create("trace:theirs", "bob")
    (first,) = await backend.append("trace:mine", [events.text_delta("a")])
    await backend.append("trace:theirs", [events.text_delta("x")] * 50)
    await backend.close("trace:theirs", events.done())
    await backend.create("subagent:other", "bob")
    (second, third) = await backend.append("trace:mine", [events.text_delta("b"), events.text_delta("c")])
    terminal, _ = await backend.close("trace:mine", events.done())
    mine = [parse_offset(o) for o in (first, second, third, terminal)]
    assert [n - mine[0] for n in mine] == [0, 1, 2, 3]
    got = [e async for e in backend.subscribe("trace:mine", second, "alice")]  # resumable from an offset
    assert [e.offset for e in got] == [third, terminal]


async def test_a_buffer_replacing_one_of_its_key_starts_above_it_whatever_the_clock() -> None:
    """With a clock that does not move (a coarse one), a replaced key's new buffer still starts above
    every offset of the one before, so a reader of the old one is told it is gone."""
    backend = MemoryBackend(wall_clock_ns=lambda: 10**18)
    await backend.create("trace:x", "alice")
    old = await backend.append("trace:x", [events.text_delta("a")] * 5)
    await backend.close("trace:x", events.done())
    await backend.create("trace:x", "alice")
    (new,) = await backend.append("trace:x", [events.text_delta("b")])
    assert parse_offset(new) > max(parse_offset(o) for o in old)
    with pytest.raises(NotFound, match="earlier buffer"):
        async for _ in backend.subscribe("trace:x", old[-1], "alice", idle_timeout_ms=50):
            pass
