"""The `auto` switch at its boundaries: any share of slow replicas, speed ratios from 1.3x to 4x,
fewer batch slots, 2 to 16 replicas, a slow replica the pick stops feeding, and a uniform pool whose
first tokens differ only by what each engine had cached.

Each case feeds the latency model what a pool of that shape serves, seeded and noisy (a quarter of
jitter either way on every observation), once a second for minutes of simulated time, and judges
after each second as the picker does (after its scrapes).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from picker.config.model import AffinityConfig
from picker.scheduling.latency import LatencyModel, tpot_features, ttft_features
from picker.scheduling.uniformity import Uniformity

DEFAULTS = AffinityConfig()


def switch() -> Uniformity:
    return Uniformity(
        DEFAULTS.latency_engage_ratio,
        DEFAULTS.latency_release_ratio,
        DEFAULTS.latency_engage_after_s,
        DEFAULTS.latency_release_after_s,
    )


def serve_one(
    model: LatencyModel,
    address: str,
    speed: float,
    now: float,
    rng: random.Random,
    first_token_only: float = 1.0,
) -> None:
    """One request served on `address` at `speed` x the normal times (20 ms + 0.1 s per 1k prefill
    tokens to the first token, 12 ms + 1 ms per running request a token), jittered; its first token
    also x `first_token_only` (a cache miss the index did not foresee)."""
    prefill = rng.uniform(200, 2000)
    running = rng.randint(1, 8)
    jitter = rng.uniform(0.75, 1.25)
    ttft = speed * first_token_only * (0.02 + prefill / 1e4) * jitter
    model.learn_ttft(address, ttft_features(prefill, 0.0), ttft, now)
    tpot = speed * (0.012 + 0.001 * running) * rng.uniform(0.75, 1.25)
    model.learn_tpot(address, tpot_features(running), tpot, now, 64)


def run(
    speeds: Mapping[str, float],
    seconds: int = 300,
    per_second: int = 4,
    fed: Mapping[str, bool] | None = None,
    slots: Mapping[str, float] | None = None,
    first_token_only: Mapping[str, float] | None = None,
    seed: int = 1,
) -> tuple[Uniformity, list[float]]:
    """Serve `per_second` requests a replica each second (a replica `fed` maps to False gets none
    while the switch is engaged, as the pick would starve it); returns the switch and when it flipped."""
    rng = random.Random(seed)
    model, judge, flips = LatencyModel(), switch(), []
    model.eager = False
    for second in range(seconds):
        now = float(second)
        for address, speed in speeds.items():
            if judge.engaged and fed is not None and not fed.get(address, True):
                continue
            for k in range(per_second):
                extra = (first_token_only or {}).get(address, 1.0) if rng.random() < 0.3 else 1.0
                serve_one(model, address, speed, now + k / per_second, rng, extra)
        model.refresh(now + 1.0)
        if judge.judge(model, now + 1.0, slots):
            flips.append(now + 1.0)
            model.eager = judge.engaged
    return judge, flips


def pool(fast: int, slow: int, ratio: float) -> dict[str, float]:
    speeds = {f"10.0.0.{i}:8000": 1.0 for i in range(fast)}
    speeds.update({f"10.0.1.{i}:8000": ratio for i in range(slow)})
    return speeds


@pytest.mark.parametrize(
    ("fast", "slow"), [(3, 1), (2, 2), (1, 3), (6, 2), (4, 4), (12, 4), (1, 1)], ids=lambda n: str(n)
)
def test_any_share_of_slow_replicas_engages_once_and_stays(fast: int, slow: int) -> None:
    judge, flips = run(pool(fast, slow, 2.0))
    assert judge.engaged and len(flips) == 1 and flips[0] <= 5.0


@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.0, 4.0])
def test_speed_ratios_up_to_four_engage(ratio: float) -> None:
    judge, flips = run(pool(3, 1, ratio))
    assert judge.engaged and len(flips) == 1


@pytest.mark.parametrize("replicas", [2, 4, 8, 16])
def test_a_uniform_pool_never_engages(replicas: int) -> None:
    for seed in range(3):
        judge, flips = run(pool(replicas, 0, 1.0), seed=seed)
        assert flips == [] and not judge.engaged, (seed, judge.last_spread)


def test_a_replica_a_third_slower_is_left_to_the_load_pick() -> None:
    """1.3x is read as such, below the engage ratio: a difference that small is left to the load
    pick, whose counts already give a slower replica less (its requests stay longer)."""
    judge, flips = run(pool(3, 1, 1.3))
    spread = judge.last_spread
    assert flips == [] and spread is not None and 1.15 < spread < DEFAULTS.latency_engage_ratio


def test_a_slow_replica_the_pick_stops_feeding_stays_measured_no_flapping() -> None:
    """Engaged, the pick sends the slow replica nothing: its observations fade, but it keeps the
    speed it was last measured at, so the switch does not release and engage again."""
    speeds = pool(3, 1, 2.0)
    slow = next(address for address, speed in speeds.items() if speed > 1)
    judge, flips = run(speeds, seconds=300, fed={slow: False})
    assert judge.engaged and len(flips) == 1


def test_first_tokens_slower_only_by_cache_misses_are_not_a_slower_replica() -> None:
    """Two equal engines, one of whose first tokens come 3x later a third of the time (prompts its
    cache no longer held, though the index said it did); both decode alike."""
    speeds = pool(2, 0, 1.0)
    first = next(iter(speeds))
    judge, flips = run(speeds, first_token_only={first: 3.0})
    assert flips == [] and not judge.engaged, judge.last_spread


def test_fewer_batch_slots_at_the_pools_load_engage() -> None:
    """Equal speeds, but one replica has 2 batch slots where the pool typically runs 4.5 a replica:
    at that load a request waits for a slot there, and nowhere else."""
    speeds = pool(4, 0, 1.0)
    small = next(iter(speeds))
    judge, flips = run(speeds, slots={address: 2.0 if address == small else 16.0 for address in speeds})
    assert judge.engaged and len(flips) == 1
    judge, flips = run(speeds, slots={small: 2.0})
    assert flips == []  # the others' slots unknown: no difference known
    judge, flips = run(speeds, slots={address: 16.0 for address in speeds})
    assert flips == []  # slots known, none short


def test_a_slow_replica_that_drains_no_longer_holds_the_switch() -> None:
    """Its held speed goes with it: a drained replica is never measured again, and the three
    uniform ones left are a uniform pool."""
    speeds = pool(3, 1, 2.0)
    slow = next(address for address, speed in speeds.items() if speed > 1)
    rng, model, judge = random.Random(2), LatencyModel(), switch()
    for second in range(120):
        now = float(second)
        for address, speed in speeds.items():
            if address != slow or second < 30:
                for k in range(4):
                    serve_one(model, address, speed, now + k / 4, rng)
        model.refresh(now + 1.0)
        ready = [a for a in speeds if a != slow or second < 30]
        judge.judge(model, now + 1.0, None, ready)
        if second == 29:
            assert judge.engaged
    assert not judge.engaged
