"""bench_ha's exact spread from the replicas' own request logs: what a gap and a misplacement read."""

from __future__ import annotations

import math

from loadtest.bench_ha import exact_spread


def request(arrival: float, end: float) -> dict[str, object]:
    return {"arrival": arrival, "end": end}


def test_even_load_is_one_and_nothing_misplaced() -> None:
    logs = [[request(0.0, 10.0), request(0.0, 10.0)] for _ in range(2)]
    mean, p95, misplaced = exact_spread(logs, 0.0, 10.0)
    assert (mean, p95, misplaced) == (1.0, 1.0, 0.0)


def test_a_gap_is_not_a_misplacement() -> None:
    # replica 0 runs one stream fewer for the second half: 2 against 1 is the best 3 over 2 can do
    logs = [[request(0.0, 10.0), request(0.0, 5.0)], [request(0.0, 10.0), request(0.0, 10.0)]]
    mean, p95, misplaced = exact_spread(logs, 0.0, 10.0)
    assert misplaced == 0.0
    assert math.isclose(p95, 2 / 1.5)
    assert math.isclose(mean, (1.0 * 5 + (2 / 1.5) * 5) / 10)


def test_three_against_one_is_misplaced_for_its_time() -> None:
    # for 2 s of 10, replica 1 runs 3 while replica 0 runs 1: the best placement gives each 2
    logs = [
        [request(0.0, 10.0), request(0.0, 4.0)],
        [request(0.0, 10.0), request(0.0, 10.0), request(4.0, 6.0)],
    ]
    _, _, misplaced = exact_spread(logs, 0.0, 10.0)
    assert math.isclose(misplaced, 0.2)


def test_outside_the_window_and_no_load_do_not_count() -> None:
    logs = [[request(0.0, 1.0)], [request(5.0, 6.0)]]
    mean, _, misplaced = exact_spread(logs, 2.0, 4.0)
    assert math.isnan(mean) and math.isnan(misplaced)
