"""The garbage collector settled once a frontend has started (picker/lifecycle/heap.py, signals.py)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from picker.config.model import PickerConfig
from picker.lifecycle import signals
from picker.lifecycle.heap import settle
from picker.lifecycle.shutdown import ShutdownSummary


class Node:
    other: object = None


def _dropped_cycle() -> weakref.ref[Node]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)  # a and b go at the return: only the collector frees them


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.enable()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)
    if not enabled:
        gc.disable()


def test_settle_freezes_what_start_built_and_spaces_young_collections(restored_gc: None) -> None:
    built = [[i] for i in range(100)]  # tracked containers start left alive
    _, older, oldest = gc.get_threshold()
    settle(10_000)
    assert gc.get_threshold() == (10_000, older, oldest)
    walked = {id(o) for o in gc.get_objects()}  # the frozen are out of every walk
    assert not any(id(item) in walked for item in built)


def test_starts_garbage_is_collected_before_the_freeze(restored_gc: None) -> None:
    gc.disable()  # nothing collects the cycle but settle
    gone = _dropped_cycle()
    assert gone() is not None
    gc.enable()
    settle(10_000)
    assert gone() is None


def test_a_cycle_dropped_after_settling_goes_at_the_next_young_collection(restored_gc: None) -> None:
    settle(1_000)
    gone = _dropped_cycle()
    held = [[] for _ in range(200)]  # well under the threshold: no collection yet
    assert gone() is not None
    held += [[] for _ in range(1_500)]  # past it: a young collection runs by itself
    assert gone() is None


def test_zero_leaves_pythons_collector_as_it_is(restored_gc: None) -> None:
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    settle(0)
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == frozen


def test_a_negative_threshold_is_refused() -> None:
    PickerConfig.model_validate({"server": {"gc_gen0_threshold": 0}})
    with pytest.raises(ValueError):
        PickerConfig.model_validate({"server": {"gc_gen0_threshold": -1}})


def test_the_frontend_settles_after_start_and_before_its_ready_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    steps: list[Any] = []

    class Frontend:
        async def start(self) -> str:
            steps.append("start")
            os.kill(os.getpid(), signal.SIGTERM)  # stop at once: handled by run_until_signalled
            return "ports"

        async def shutdown(self, force: asyncio.Event) -> ShutdownSummary:
            steps.append("shutdown")
            return ShutdownSummary()

    monkeypatch.setattr(signals, "settle", lambda threshold: steps.append(("settle", threshold)))
    asyncio.run(
        signals.run_until_signalled(Frontend(), lambda p: steps.append("ready") or p, gc_gen0_threshold=7)
    )
    assert steps == ["start", ("settle", 7), "ready", "shutdown"]
