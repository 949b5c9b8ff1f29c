"""The garbage collector settled once a frontend has started (picker/lifecycle/heap.py)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from picker.config.model import PickerConfig
from picker.lifecycle.heap import settle


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_settle_freezes_what_start_built_and_spaces_young_collections(restored_gc: None) -> None:
    built = [object() for _ in range(100)]  # what start left alive
    _, older, oldest = gc.get_threshold()
    settle(10_000)
    assert gc.get_freeze_count() >= len(built)
    assert gc.get_threshold() == (10_000, older, oldest)


def test_cycles_are_still_collected_after_settling(restored_gc: None) -> None:
    settle(10_000)

    class Node:
        other: object = None

    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    assert gone() is not None  # a cycle: only the collector frees it
    gc.collect(0)  # a young collection, as the threshold triggers it
    assert gone() is None


def test_zero_leaves_pythons_collector_as_it_is(restored_gc: None) -> None:
    before = gc.get_threshold()
    frozen = gc.get_freeze_count()
    settle(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_the_default_and_its_validation() -> None:
    assert PickerConfig().server.gc_gen0_threshold == 10_000
    with pytest.raises(ValueError):
        PickerConfig.model_validate({"server": {"gc_gen0_threshold": -1}})
