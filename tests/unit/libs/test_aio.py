"""settle_heap: what a process built is frozen out of the collector's walks, and young collections come
less often (docs/operations.md, "Garbage collection"). The test puts this process's collector back."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from agentmesh.libs.aio import YOUNG_COLLECTION_EVERY, settle_heap
from agentmesh.libs.metrics import process_series


@pytest.fixture
def collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_heap_freezes_what_exists_and_spaces_young_collections(collector: None) -> None:
    built = [{"n": i} for i in range(1_000)]  # tracked containers the process made before it served
    old_threshold = gc.get_threshold()
    settle_heap()
    assert gc.get_freeze_count() >= len(built) + 10_000  # and this process's modules
    assert gc.get_threshold() == (YOUNG_COLLECTION_EVERY, *old_threshold[1:])
    assert YOUNG_COLLECTION_EVERY > old_threshold[0]


def test_a_scrape_reads_the_frozen_count_without_walking_the_heap(
    collector: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc.get_freeze_count() walks every frozen object (about 15 ms for 200,000): asked on each scrape,
    it stalled the event loop each time a Prometheus server read /metrics."""
    settle_heap()
    frozen = gc.get_freeze_count()

    def walk() -> int:
        raise AssertionError("a scrape walked the frozen heap")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    registry = process_series(CollectorRegistry())
    assert registry.get_sample_value("agentmesh_gc_frozen_objects") == frozen
