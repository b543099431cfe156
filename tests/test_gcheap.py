"""The startup heap is kept out of the garbage collector's way, and what serving makes is still collected."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from shared.runtime import gcheap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()


def test_a_full_collection_after_startup_visits_only_what_came_later(unfrozen: None) -> None:
    startup = [Node() for _ in range(10_000)]
    gcheap.freeze_startup_heap()
    assert gc.get_freeze_count() >= len(startup)
    tracked_after = len(gc.get_objects())
    assert tracked_after < len(startup)  # a full collection walks what is tracked: the startup heap is not

    later = Node()
    later.other = Node()
    later.other.other = later  # a cycle made while serving
    gone = weakref.ref(later)
    del later
    gc.collect()
    assert gone() is None
