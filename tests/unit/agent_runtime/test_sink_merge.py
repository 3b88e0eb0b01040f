"""The runtime's sink merges runs of deltas nobody waits for (docs/design/streams.md, "Merged deltas")."""

from __future__ import annotations

import asyncio

from agentmesh.events.v1 import events_pb2 as ev
from agentmesh.libs import events
from agentmesh.libs.errors import Internal
from agentmesh.services.agent_runtime.sink import _MERGE_CHARS, merged


def shown(entries: list) -> list[tuple[str, str, bool]]:
    out = []
    for event, fut in entries:
        kind = events.kind(event)
        text = getattr(getattr(event, kind), kind) if kind in ("text_delta", "reasoning_delta") else ""
        out.append((kind, text, fut is not None))
    return out


def test_runs_of_one_kind_merge_and_anything_else_breaks_a_run() -> None:
    waited: asyncio.Future[str] = asyncio.new_event_loop().create_future()
    pending = [
        (events.text_delta("a"), None),
        (events.text_delta("b"), None),
        (events.reasoning_delta("r"), None),
        (events.reasoning_delta("s"), None),
        (events.text_delta("c"), waited),  # someone waits for its own offset: alone
        (events.text_delta("d"), None),
        (events.text_delta("e"), None),
        (events.error(Internal("x")), None),
        (events.text_delta("z"), None),
    ]
    assert shown(merged(pending)) == [
        ("text_delta", "ab", False),
        ("reasoning_delta", "rs", False),
        ("text_delta", "c", True),
        ("text_delta", "de", False),
        ("error", "", False),
        ("text_delta", "z", False),
    ]


def test_a_merged_delta_stays_under_its_size_and_keeps_every_character_in_order() -> None:
    piece = "word " * 100
    pending: list[tuple[ev.Event, asyncio.Future[str] | None]] = [
        (events.text_delta(f"{i:04d}{piece}"), None) for i in range(200)
    ]
    out = merged(pending)
    texts = [event.text_delta.text_delta for event, _ in out]
    assert 1 < len(out) < len(pending)
    assert all(len(t) <= _MERGE_CHARS for t in texts)
    assert "".join(texts) == "".join(event.text_delta.text_delta for event, _ in pending)


def test_nothing_to_merge_is_left_as_it_was() -> None:
    pending: list[tuple[ev.Event, asyncio.Future[str] | None]] = [(events.text_delta("only"), None)]
    assert shown(merged(pending)) == [("text_delta", "only", False)]
    assert merged([]) == []
