"""bench_routing's pure parts: the pools, the rate from capacity, the seeded arrivals, the row names."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.bench_routing import (
    DEFAULT_ROWS,
    POOLS,
    WORKLOADS,
    alone_ttft_ms,
    arrivals,
    capacity,
    make_plan,
    parse_rows,
    pin_groups,
    prompt_tokens,
    slot_seconds,
)


def test_default_rows_cover_every_pool_once_and_every_workload_twice() -> None:
    rows = parse_rows(",".join(DEFAULT_ROWS))
    assert {r.pool.name for r in rows} == set(POOLS)
    for workload in WORKLOADS:
        assert sum(r.workload.name == workload for r in rows) >= 2, workload


def test_unknown_row_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="one-slow"):
        parse_rows("uniform/plain,nope/plain")
    with pytest.raises(ValueError, match="long-output"):
        parse_rows("uniform/nope")


def test_pools_mark_their_slower_fewer_slots_and_restarting_replicas() -> None:
    assert POOLS["one-slow"].marks() == ["", "", "", "s"]
    assert POOLS["most-slow"].slowdown == (1.0, 2.0, 2.0, 2.0)
    assert POOLS["fewer-slots"].slots == (8, 8, 8, 4)
    assert POOLS["fewer-slots"].marks() == ["", "", "", "h"]
    assert POOLS["restart"].marks() == ["r", "", "", ""]
    assert POOLS["eight"].marks().count("s") == 2 and POOLS["sixteen"].size == 16


def test_capacity_counts_slots_over_slot_time_and_slowdown() -> None:
    assert prompt_tokens("abcdefgh") == 2 and prompt_tokens("abcdefghi") == 3
    # 20 ms + 0.03 ms x 1000 tokens + 12 ms x 50 tokens = 650 ms
    assert math.isclose(slot_seconds("x" * 4000, 50), 0.65)
    assert math.isclose(capacity(POOLS["uniform"], 0.5), 4 * 8 / 0.5)
    assert math.isclose(capacity(POOLS["one-slow"], 0.5), 3 * 16 + 8)
    assert math.isclose(capacity(POOLS["fewer-slots"], 1.0), 28)


def test_poisson_and_bursty_arrivals_keep_the_mean_rate() -> None:
    plain = arrivals(50.0, 200.0, random.Random(1))
    bursty = arrivals(50.0, 200.0, random.Random(1), bursts=True)
    assert 0.95 < len(plain) / 10_000 < 1.05
    assert 0.95 < len(bursty) / 10_000 < 1.05
    assert all(0 <= a < 200 for a in (*plain, *bursty)) and bursty == sorted(bursty)
    in_burst = sum(a % 2.0 < 0.5 for a in bursty)  # 0.5 s at 3x, 1.5 s at 1/3: 75 % in the bursts
    assert 0.72 < in_burst / len(bursty) < 0.78


def test_a_plan_is_the_same_for_the_same_seed_and_sized_by_the_load() -> None:
    row = parse_rows("half-slow/shared")[0]
    first, again = make_plan(row, 0.7, 5.0, 63), make_plan(row, 0.7, 5.0, 63)
    assert first.requests == again.requests
    assert math.isclose(first.rate, 0.7 * first.capacity)
    assert 0.6 * first.rate * 5 < len(first.requests) < 1.4 * first.rate * 5
    # shared: every prompt opens with one of 2 x 4 = 8 system prompts
    assert len({p.split(" Question: ")[0] for _, p, _ in first.requests}) == 8
    assert make_plan(row, 0.35, 5.0, 63).rate < first.rate


def test_the_floor_counts_only_what_a_warm_idle_replica_computes() -> None:
    plan = make_plan(parse_rows("uniform/shared")[0], 0.7, 5.0, 63)
    prompt = plan.requests[0][1]
    system = prompt.partition(" Question: ")[0]
    held = prompt_tokens(system) // 16 * 16
    assert alone_ttft_ms(prompt) == pytest.approx(20.0 + 0.03 * (prompt_tokens(prompt) - held))
    assert alone_ttft_ms(prompt) < 20.0 + 0.03 * 200  # the question and a block's remainder
    assert alone_ttft_ms("x" * 400) == pytest.approx(20.0 + 0.03 * 100)  # nothing shared
    assert 20.0 < plan.floor_ms < 30.0


def test_the_oracle_pins_groups_by_capacity_within_what_a_cache_holds() -> None:
    def counts(pool: str) -> list[int]:
        pinned = pin_groups(POOLS[pool], WORKLOADS["shared"].groups(POOLS[pool]))
        return [pinned.count(i) for i in range(POOLS[pool].size)]

    assert counts("uniform") == [2, 2, 2, 2]
    assert counts("half-slow") == [3, 3, 1, 1]  # twice the capacity, up to the three a cache holds
    assert max(counts("most-slow")) == 3 and sum(counts("most-slow")) == 8
    assert counts("sixteen") == [2] * 16
