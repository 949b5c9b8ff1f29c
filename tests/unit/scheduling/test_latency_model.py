"""The per-replica latency model (picker/scheduling/latency.py): it learns each replica's speed from
observations alone, a cold replica starts from the pool's figures, a change is re-learned within
seconds, an outlier moves little, and a replica left alone slides back to the pool's figures."""

from __future__ import annotations

import random

import pytest

from picker.scheduling.latency import DecayedFit, LatencyModel, tpot_features, ttft_features

FAST, SLOW = "10.0.0.1:8000", "10.0.0.2:8000"


def feed(
    model: LatencyModel, address: str, speed: float, start: float, count: int, rng: random.Random
) -> float:
    """`count` requests 0.02 s apart on a replica whose TTFT is speed x (20 ms + 0.5 s per 1k
    prefill tokens ahead + 60 ms per queued request) and TPOT speed x (10 ms + 1 ms per running)."""
    now = start
    for _ in range(count):
        tokens, queued, running = rng.uniform(0, 2000), rng.choice([0, 0, 0, 1, 2]), rng.randint(1, 8)
        x = ttft_features(tokens, queued)
        ttft = speed * (0.02 + 0.5 * tokens / 1000 + 0.06 * queued) * rng.uniform(0.95, 1.05)
        model.learn_ttft(address, x, ttft, now)
        model.learn_tpot(address, tpot_features(running), speed * (0.01 + 0.001 * running), now)
        now += 0.02
    return now


def close(a: float, b: float, within: float) -> bool:
    return abs(a - b) <= within * b


def test_it_learns_each_replicas_figures_and_tells_a_slow_one_apart() -> None:
    model, rng = LatencyModel(half_life_s=5.0), random.Random(1)
    now = feed(model, FAST, 1.0, 0.0, 200, rng)
    now = feed(model, SLOW, 2.0, now, 200, rng)
    x = ttft_features(1000, 1)
    assert close(model.ttft(FAST, x), 0.58, 0.1) and close(model.ttft(SLOW, x), 1.16, 0.1)
    assert close(model.tpot(FAST, tpot_features(4)), 0.014, 0.1)
    assert close(model.tpot(SLOW, tpot_features(4)), 0.028, 0.1)
    summary = model.summary()
    assert summary[FAST]["ttft_mape"] is not None and summary[FAST]["ttft_mape"] < 0.2  # type: ignore[operator]


def test_a_cold_replica_starts_from_the_pools_figures() -> None:
    model, rng = LatencyModel(), random.Random(2)
    now = feed(model, FAST, 1.0, 0.0, 200, rng)
    x = ttft_features(500, 0)
    pool = sum(p * v for p, v in zip(model.pool.ttft_params, x, strict=True))
    assert model.ttft("10.0.0.9:8000", x) == pool  # the pool's own figures
    assert close(pool, model.ttft(FAST, x), 0.15)  # which are what the pool has seen
    assert "10.0.0.9:8000" not in model.replicas
    assert now > 0


def test_a_replica_that_turns_slow_is_relearned_within_seconds() -> None:
    model, rng = LatencyModel(half_life_s=2.0), random.Random(3)
    now = feed(model, SLOW, 1.0, 0.0, 300, rng)  # 6 s at normal speed
    x = ttft_features(1000, 0)
    before = model.ttft(SLOW, x)
    now = feed(model, SLOW, 2.0, now, 100, rng)  # then twice as slow, for 2 s
    assert close(model.ttft(SLOW, x), 2 * before, 0.15)


def test_an_outlier_moves_little() -> None:
    model, rng = LatencyModel(), random.Random(4)
    now = feed(model, FAST, 1.0, 0.0, 200, rng)
    x = ttft_features(1000, 0)
    before = model.ttft(FAST, x)
    model.learn_ttft(FAST, x, 30.0, now)  # one stalled request
    assert close(model.ttft(FAST, x), before, 0.1)
    model.learn_ttft(FAST, x, float("inf"), now)  # nonsense is ignored
    model.learn_ttft(FAST, x, -1.0, now)
    assert close(model.ttft(FAST, x), before, 0.1)


def test_a_replica_left_alone_slides_back_to_the_pool() -> None:
    model, rng = LatencyModel(half_life_s=2.0), random.Random(5)
    now = feed(model, FAST, 1.0, 0.0, 200, rng)
    now = feed(model, SLOW, 3.0, now, 200, rng)
    x = ttft_features(1000, 0)
    assert model.ttft(SLOW, x) > 2.5 * model.ttft(FAST, x)
    now = feed(model, FAST, 1.0, now, 600, rng)  # 12 s with no traffic to the slow one
    model.refresh(now)
    assert model.ttft(SLOW, x) < 1.5 * model.ttft(FAST, x)  # so it gets traffic again, and is measured


def test_a_model_not_routed_by_fits_at_refresh_not_at_every_observation() -> None:
    """affinity.latency auto, not engaged: observations add up (cheap) and `refresh` (after a scrape,
    at most once a second) fits them; the fit is the one an eager model reaches."""
    lazy, eager = LatencyModel(30.0), LatencyModel(30.0)
    lazy.eager = False
    for i in range(40):
        for model in (lazy, eager):
            model.learn_ttft("a", (1.0, 0.5, 0.0), 0.08, i * 0.01)
            model.learn_tpot("a", (1.0, 2.0), 0.03, i * 0.01, 8)
    assert lazy.replicas["a"].ttft_params == lazy.pool.ttft_params  # not fitted yet: the pool's start
    lazy.refresh(0.4)
    eager.refresh(0.4)
    assert lazy.replicas["a"].ttft_params == pytest.approx(eager.replicas["a"].ttft_params, rel=0.05)
    assert lazy.replicas["a"].tpot_params == pytest.approx(eager.replicas["a"].tpot_params, rel=0.05)


def test_ageing_and_the_memory_cap_keep_the_fit_of_scaling_every_sum() -> None:
    """The sums are aged and capped through one scale (picker/scheduling/latency.py `DecayedFit`):
    the fit is the one that scales every sum at every observation, through a long silence (the scale
    folded into the sums) and past the memory cap."""
    fit = DecayedFit(2, 5.0)
    plain_xx, plain_xy, plain_w, at = [[0.0, 0.0], [0.0, 0.0]], [0.0, 0.0], 0.0, 0.0
    for k in range(120):
        now = k * 0.1 if k < 60 else 300.0 + k * 0.1  # a 294 s silence: 59 half-lives
        x, y = (1.0, float(1 + k % 5)), 0.01 + 0.002 * (k % 5)
        factor = 0.5 ** ((now - at) / 5.0)
        plain_xx = [[v * factor for v in row] for row in plain_xx]
        plain_xy, plain_w, at = [v * factor for v in plain_xy], plain_w * factor, now
        plain_xx = [[plain_xx[i][j] + x[i] * x[j] for j in range(2)] for i in range(2)]
        plain_xy, plain_w = [plain_xy[i] + x[i] * y for i in range(2)], plain_w + 1.0
        if plain_w > 30.0:
            cap = 30.0 / plain_w
            plain_xx = [[v * cap for v in row] for row in plain_xx]
            plain_xy, plain_w = [v * cap for v in plain_xy], 30.0
        fit.observe(x, y, now, None)
        assert fit.weight == pytest.approx(plain_w)
    ridge = 5.0
    a = [[plain_xx[i][j] + (ridge if i == j else 0.0) for j in range(2)] for i in range(2)]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    b = [plain_xy[0] + ridge * 0.02, plain_xy[1]]
    expected = ((b[0] * a[1][1] - a[0][1] * b[1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det)
    assert fit.solve((0.02, 0.0), at) == pytest.approx(expected)


def test_observations_at_one_instant_past_the_memory_never_break_the_fit() -> None:
    """Ends arrive out of order, a fake clock repeats: the cap alone shrinks the scale, which is
    folded into the sums before it underflows (30,000 at one instant made it NaN, then divided by 0)."""
    fit = DecayedFit(2, 5.0)
    for _ in range(30_000):
        fit.observe((1.0, 2.0), 0.01, 1.0, None)
    assert fit.weight == pytest.approx(30.0)
    base, per_running = fit.solve((0.02, 0.0), 1.0)
    assert base + 2 * per_running == pytest.approx(0.01, rel=0.05)  # the ridge pulls a little
