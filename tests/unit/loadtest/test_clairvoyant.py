"""The proving ground's clairvoyant dispatcher: the simulator's timing model, replayed exactly."""

from __future__ import annotations

import pytest

from loadtest.bench_routing import (
    DEFAULT_ROWS,
    POOLS,
    clairvoyant_ms,
    group_of,
    make_plan,
    parse_rows,
)
from loadtest.clairvoyant import Model, Replica, Request, dispatch

MODEL = Model(ttft_ms=20.0, prefill_ms_per_token=0.1, itl_ms=10.0)


def test_a_request_waits_for_the_slot_the_one_before_it_holds() -> None:
    # first: 20 + 0.1 x 100 = 30 ms to its first token, then 9 more tokens of 10 ms: free at 120 ms
    ttfts = dispatch([Replica(slots=1)], [Request(0.0, 100, 10), Request(0.0, 100, 10)], MODEL)
    assert ttfts == pytest.approx([30.0, 150.0])


def test_the_soonest_first_token_wins_a_slower_replica_when_the_quick_one_is_full() -> None:
    pool = [Replica(slots=1), Replica(slots=1, slowdown=2.0)]
    requests = [Request(0.0, 100, 10), Request(0.0, 100, 10), Request(0.0, 100, 10)]
    # the quick one first; the slow one's 60 ms beats a 120-ms wait; the third waits for the quick one
    assert dispatch(pool, requests, MODEL) == pytest.approx([30.0, 60.0, 150.0])


def test_a_held_prefix_is_not_computed_again_and_the_least_recent_group_is_evicted() -> None:
    model = Model(ttft_ms=20.0, prefill_ms_per_token=0.1, itl_ms=10.0, cached_groups=1)
    one = [Replica(slots=4)]
    ask = [
        Request(0.0, 1000, 1, group=0, held_tokens=900),  # a miss: 20 + 100
        Request(1.0, 1000, 1, group=0, held_tokens=900),  # a hit: 20 + 10
        Request(2.0, 1000, 1, group=1, held_tokens=900),  # a miss, evicting group 0
        Request(3.0, 1000, 1, group=0, held_tokens=900),  # a miss again
    ]
    assert dispatch(one, ask, model) == pytest.approx([120.0, 30.0, 120.0, 120.0])


def test_a_restarting_replica_is_slower_for_what_arrives_before_it_is_warm() -> None:
    warming = [Replica(slots=8, warm_factor=5.0, warm_until_s=1.0)]
    assert dispatch(warming, [Request(0.5, 100, 1), Request(1.5, 100, 1)], MODEL) == pytest.approx(
        [150.0, 30.0]
    )


def test_requests_out_of_arrival_order_are_refused() -> None:
    with pytest.raises(ValueError, match="arrival"):
        dispatch([Replica(slots=1)], [Request(1.0, 10, 1), Request(0.5, 10, 1)], MODEL)


def test_the_proving_grounds_clairvoyant_reading_is_never_below_the_floor_and_at_it_when_idle() -> None:
    for name in DEFAULT_ROWS:
        row = parse_rows(name)[0]
        plan = make_plan(row, 0.7, 5.0, 63)
        assert clairvoyant_ms(row, plan, 5.0) >= plan.floor_ms - 1e-6, name
    # a uniform pool at a tenth of its capacity, no prefix shared: nothing ever waits
    row = parse_rows("uniform/plain")[0]
    light = make_plan(row, 0.1, 5.0, 63)
    assert clairvoyant_ms(row, light, 5.0) == pytest.approx(light.floor_ms)


def test_shared_prompts_name_their_group_and_others_none() -> None:
    plan = make_plan(parse_rows("uniform/shared")[0], 0.7, 5.0, 63)
    groups = {group_of(prompt) for _, prompt, _ in plan.requests}
    assert groups <= set(range(len(POOLS["uniform"].slots) * 2)) and len(groups) > 1
    assert group_of("plain words") is None
