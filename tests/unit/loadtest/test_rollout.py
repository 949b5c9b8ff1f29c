"""The rollout benchmark's pure parts: the maxSurge/maxUnavailable controller, the seeded arrivals,
the client-outcome classes, and the timeline picture drawn from plain events."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from loadtest.rollout.load import LoadReport, Outcome, poisson_arrivals
from loadtest.rollout.rolling import roll
from loadtest.rollout.timeline import (
    Panel,
    draw,
    error_event,
    in_flight_series,
    mark_event,
    state_event,
    stream_event,
)
from loadtest.sse_client import SseEvent, StreamResult


class FakeFleet:
    def __init__(self, n: int) -> None:
        self.first = [f"old-{i}" for i in range(n)]
        self.replacements = [f"new-{i}" for i in range(n)]
        self.serving = set(self.first)  # ready and not terminating
        self.alive = set(self.first)  # not terminating (starting or ready)
        self.peak_alive = len(self.alive)
        self.low_serving = len(self.serving)

    async def start(self, address: str) -> None:
        self.alive.add(address)
        self.peak_alive = max(self.peak_alive, len(self.alive))
        await asyncio.sleep(0.01)


class FakeSetup:
    title = url = "fake"

    def __init__(self, fleet: FakeFleet) -> None:
        self.fleet = fleet
        self.order: list[str] = []

    async def add(self, address: str) -> None:
        self.fleet.serving.add(address)
        self.order.append(f"+{address}")

    async def terminate(self, address: str) -> None:
        self.fleet.serving.discard(address)
        self.fleet.alive.discard(address)
        self.fleet.low_serving = min(self.fleet.low_serving, len(self.fleet.serving))
        self.order.append(f"-{address}")
        await asyncio.sleep(0.05)  # terminating takes a while; the controller does not wait for it


@pytest.mark.parametrize(("surge", "unavailable"), [(1, 0), (0, 1), (2, 1), (1, 1)])
async def test_roll_keeps_within_surge_and_unavailable(surge: int, unavailable: int) -> None:
    fleet = FakeFleet(4)
    setup = FakeSetup(fleet)
    await roll(fleet, setup, surge, unavailable)  # type: ignore[arg-type]
    assert fleet.serving == set(fleet.replacements)
    assert fleet.peak_alive <= 4 + surge
    assert fleet.low_serving >= 4 - unavailable
    assert sorted(setup.order) == sorted([f"+new-{i}" for i in range(4)] + [f"-old-{i}" for i in range(4)])


async def test_roll_refuses_a_strategy_that_cannot_move() -> None:
    fleet = FakeFleet(2)
    with pytest.raises(ValueError):
        await roll(fleet, FakeSetup(fleet), 0, 0)  # type: ignore[arg-type]


def test_arrivals_are_seeded_and_bounded() -> None:
    a = poisson_arrivals(20, 10, (5, 9), seed=3)
    assert a == poisson_arrivals(20, 10, (5, 9), seed=3)
    assert a != poisson_arrivals(20, 10, (5, 9), seed=4)
    assert 120 < len(a) < 280 and all(0 < x.at_s < 10 and 5 <= x.max_tokens <= 9 for x in a)


def _result(**fields: Any) -> StreamResult:
    result = StreamResult(**fields)
    return result


def test_outcomes_are_classified_once() -> None:
    done = [SseEvent('{"choices": [{"text": "a", "finish_reason": "length"}]}', 0.1), SseEvent("[DONE]", 0.2)]
    abort = [SseEvent('{"choices": [{"text": "", "finish_reason": "abort"}]}', 0.1), SseEvent("[DONE]", 0.2)]
    cases = {
        "completed": _result(status=200, events=done, end="done"),
        "abort": _result(status=200, events=abort, end="done"),
        "truncated": _result(status=200, events=done[:1], end="eof"),
        "http-500": _result(status=500),
        "contract-503": _result(status=503, headers={"x-picker-dropped-reason": "rejected-shutting-down"}),
        "hung": _result(status=200, end="timeout"),
        "conn-error": _result(end="refused"),
    }
    report = LoadReport([Outcome(0.0, r) for r in cases.values()])
    assert [o.kind for o in report.outcomes] == list(cases)
    assert report.contract_reasons() == {"503 rejected-shutting-down": 1}


def test_the_picture_is_drawn_from_plain_events(tmp_path: Path) -> None:
    events = [
        state_event(0, "r1", "ready"),
        state_event(2, "r1", "draining"),
        state_event(3, "r1", "gone"),
        mark_event(2.5, "r1", "SIGTERM"),
        state_event(0, "r2", "ready"),
        *(stream_event(0.1 * i, 0.1 * i + 1, "r1", 0.05) for i in range(20)),
        error_event(2.2, "HTTP 500", "r1"),
        error_event(2.4, "conn error"),
    ]
    assert max(in_flight_series(events, "r1", 4)[1]) == 10
    with pytest.raises(ValueError):
        state_event(0, "r1", "sleeping")
    path = draw([Panel("one", events), Panel("two", events[:5])], tmp_path / "t.png", "title")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
