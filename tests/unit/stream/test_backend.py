"""services.stream.backend without a network: key validation and the coalescing of text deltas."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import InvalidArgument
from agentmesh.services.stream.backend import coalesce, validate_key


def deltas(*texts: str) -> list[ev.Event]:
    return [events.text_delta(t) for t in texts]


def test_validate_key() -> None:
    assert validate_key("a2a:t-1") == "a2a:t-1"
    assert validate_key("trace:" + "x" * 64) == "trace:" + "x" * 64
    for bad in ("foo:1", "session", "trace:", "subagent:" + "x" * 65, "subagent:" + "x" * 201, "", ":x"):
        with pytest.raises(InvalidArgument, match="invalid stream key"):
            validate_key(bad)


def test_coalesce_merges_only_consecutive_text_deltas() -> None:
    batch = [
        *deltas("a", "b"),
        events.reasoning_delta("r"),
        events.reasoning_delta("s"),
        *deltas("c", "d", "e"),
    ]
    for i, e in enumerate(batch):
        e.offset = f"{i:020d}"
    out = coalesce(batch)
    assert [events.kind(e) for e in out] == ["text_delta", "reasoning_delta", "reasoning_delta", "text_delta"]
    assert (out[0].text_delta.text_delta, out[0].offset) == ("ab", batch[1].offset)
    assert (out[1], out[2]) == (batch[2], batch[3])  # everything else passes unchanged
    assert (out[3].text_delta.text_delta, out[3].offset) == ("cde", batch[6].offset)


def test_coalesce_of_nothing_and_of_one() -> None:
    assert coalesce([]) == []
    [one] = deltas("x")
    one.offset = "7"
    assert coalesce([one]) == [one]


def _event(kind: str, text: str) -> ev.Event:
    if kind == "text":
        return events.text_delta(text)
    if kind == "reasoning":
        return events.reasoning_delta(text)
    return events.done()


batches = st.lists(
    st.tuples(st.sampled_from(["text", "text", "reasoning", "done"]), st.text(max_size=5)), max_size=40
).map(lambda items: [_event(k, t) for k, t in items])


@given(batches)
def test_coalesce_keeps_text_order_and_offsets(batch: list[ev.Event]) -> None:
    for i, e in enumerate(batch):
        e.offset = f"{i + 1:020d}"
    out = coalesce(batch)
    text = "".join(e.text_delta.text_delta for e in batch if events.kind(e) == "text_delta")
    assert "".join(e.text_delta.text_delta for e in out if events.kind(e) == "text_delta") == text
    others = [e for e in batch if events.kind(e) != "text_delta"]
    assert [e for e in out if events.kind(e) != "text_delta"] == others  # untouched, in order
    kinds = [events.kind(e) for e in out]
    assert all(not (a == b == "text_delta") for a, b in itertools.pairwise(kinds))  # runs merged
    offsets = [e.offset for e in out]
    assert offsets == sorted(offsets) and set(offsets) <= {e.offset for e in batch}
    if batch:
        assert out[-1].offset == batch[-1].offset  # a run keeps its last offset: resuming skips nothing
    assert coalesce(out) == out
