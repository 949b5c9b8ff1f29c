"""`affinity.latency: auto` (issue 54): the model learns always; the pick routes by its predictions only
once the pool is measurably not uniform for a while, and stops once it is uniform again (hysteresis).
A uniform pool is left alone: its picks are those of `off`."""

from __future__ import annotations

import random

import pytest

from picker.config.model import AffinityConfig, ConfigError
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.placement import Placement
from picker.scheduling import LoadPolicy
from picker.scheduling.latency import LatencyModel, tpot_features, ttft_features
from picker.scheduling.uniformity import Uniformity, spread
from picker.streams import RequestRecord

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def learn(model: LatencyModel, address: str, speed: float, now: float, times: int = 8) -> None:
    """`times` requests served on `address` at `speed` x the normal time (20 ms + 0.1 s per 1k tokens,
    15 ms a token)."""
    for k in range(times):
        prefill = 500.0 + 250 * (k % 4)
        model.learn_ttft(address, ttft_features(prefill, 0.0), speed * (0.02 + prefill / 1e4), now)
        model.learn_tpot(address, tpot_features(1 + k % 4), speed * 0.015, now, 32)


def test_the_spread_is_none_until_two_replicas_are_measured() -> None:
    model = LatencyModel()
    assert spread(model) is None
    learn(model, A, 1.0, 0.0)
    assert spread(model) is None
    learn(model, B, 1.0, 0.0)
    assert spread(model) == pytest.approx(1.0, abs=0.05)
    learn(model, C, 2.0, 0.0)
    assert spread(model) == pytest.approx(2.0, rel=0.15)


def test_engages_only_after_the_spread_held_for_engage_after_s() -> None:
    switch = Uniformity(engage_ratio=1.5, release_ratio=1.25, engage_after_s=5.0, release_after_s=8.0)
    assert not switch.check(2.0, 0.0)
    assert not switch.check(2.0, 4.9) and not switch.engaged
    assert switch.check(2.0, 5.0) and switch.engaged


def test_a_passing_spread_does_not_engage() -> None:
    switch = Uniformity(engage_ratio=1.6, release_ratio=1.3, engage_after_s=5.0, release_after_s=10.0)
    switch.check(2.0, 0.0)
    switch.check(1.1, 3.0)  # uniform again: the clock restarts
    assert not switch.check(2.0, 6.0)
    assert not switch.check(2.0, 10.9) and not switch.engaged
    assert switch.check(2.0, 11.0)


def test_hysteresis_between_the_two_ratios_holds_either_state() -> None:
    switch = Uniformity(engage_ratio=1.5, release_ratio=1.25, engage_after_s=1.0, release_after_s=3.0)
    for t in range(10):
        assert not switch.check(1.4, float(t))  # below engage: stays released
    switch.check(1.6, 10.0)
    assert switch.check(1.6, 11.0) and switch.engaged
    for t in range(12, 30):
        assert not switch.check(1.4, float(t))  # above release: stays engaged
        assert not switch.check(None, float(t) + 0.5)  # nothing measured: holds
    assert switch.engaged
    switch.check(1.2, 30.0)
    assert not switch.check(1.2, 32.9) and switch.engaged  # released only after release_after_s
    assert switch.check(1.2, 33.0) and not switch.engaged


def test_release_above_engage_is_a_configuration_error() -> None:
    with pytest.raises((ConfigError, ValueError), match="latency_release_ratio"):
        AffinityConfig(latency_engage_ratio=1.3, latency_release_ratio=1.4)


@pytest.mark.parametrize(("given", "means"), [(True, "on"), (False, "off"), ("true", "on"), ("auto", "auto")])
def test_true_and_false_still_mean_on_and_off(given: object, means: str) -> None:
    assert AffinityConfig(latency=given).latency == means  # type: ignore[arg-type]
    assert AffinityConfig().latency == "auto"


def placement_of(latency: str, metrics: Metrics) -> tuple[Placement, Pool, list[float]]:
    now = [0.0]
    pool = Pool(clock=lambda: now[0])
    pool.apply(ready=[A, B, C])
    config = AffinityConfig(latency=latency, latency_engage_after_s=3.0, latency_release_after_s=6.0)  # type: ignore[arg-type]
    return Placement(pool, config, metrics, None), pool, now


def picks(placement: Placement, pool: Pool, now: float, count: int = 40) -> list[tuple[list[str], str]]:
    for n, endpoint in enumerate(pool.endpoints()):
        record_sample(endpoint, running=n % 2, waiting=0, kv_usage=0.1, now=now)
    out = []
    rng = random.Random(5)
    for i in range(count):
        prompt = b"system %d " % (i % 3) * 400
        request = InferenceRequest(
            method="POST", path="/v1/completions", model="m", stream=True, prompt=prompt
        )
        record = RequestRecord(request_id=str(i), admitted_at=now, keys=placement.keys(request, None, None))
        choice = placement.choose(record, pool.ready(), 2, rng, now, LoadPolicy(), frozenset())
        assert choice is not None
        out.append((choice.destinations, choice.reason))
        assert record.ttft_x is not None or placement.latency is None  # learned from, engaged or not
    return out


def gauge(metrics: Metrics) -> float | None:
    return metrics.registry.get_sample_value("picker_latency_engaged")


def test_a_uniform_pool_is_left_alone_its_picks_those_of_off() -> None:
    auto_metrics = Metrics(pool="default")
    auto, auto_pool, now = placement_of("auto", auto_metrics)
    off, off_pool, _ = placement_of("off", Metrics(pool="default"))
    assert auto.latency is not None
    for t in range(0, 20):
        now[0] = float(t)
        for address in (A, B, C):
            learn(auto.latency, address, 1.0 + 0.05 * (address == C), now[0], times=2)
        auto.tune()
        assert picks(auto, auto_pool, now[0], 10) == picks(off, off_pool, now[0], 10)
    assert not auto.engaged and gauge(auto_metrics) == 0.0


def test_a_pool_that_is_not_uniform_engages_after_a_while_then_releases(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metrics = Metrics(pool="default")
    placement, pool, now = placement_of("auto", metrics)
    assert placement.latency is not None and not placement.engaged
    caplog.set_level("INFO", logger="picker.request.placement")
    slow = 2.0
    for t in range(0, 12):
        now[0] = float(t)
        for address in (A, B, C):
            learn(placement.latency, address, slow if address == C else 1.0, now[0], times=2)
        placement.tune()
        if t < 3:
            assert not placement.engaged  # not for the first engage_after_s
    assert placement.engaged and gauge(metrics) == 1.0
    assert any(reason == "score" for _, reason in picks(placement, pool, now[0]))
    assert all(C not in destinations[:1] for destinations, _ in picks(placement, pool, now[0]))
    slow = 1.0
    for t in range(12, 40):
        now[0] = float(t)
        for address in (A, B, C):
            learn(placement.latency, address, slow, now[0], times=3)
        placement.tune()
    assert not placement.engaged and gauge(metrics) == 0.0
    switches = [r.getMessage() for r in caplog.records if "affinity.latency auto" in r.getMessage()]
    assert len(switches) == 2 and "engaged" in switches[0] and "released" in switches[1]


def test_a_loaded_pool_is_compared_where_its_replicas_run() -> None:
    """Replicas measured only with 13-16 requests running beside each (a pool near its capacity,
    bench_shapes): two at 12 ms a token, one at 24. Each fit is right where it was measured, but its
    intercept leans on the pool's prior and its slope makes up for it: compared at four running (an
    extrapolation) the slow one looked 1.24x the median and auto never engaged. Compared at the
    running the pool was measured at, it is twice as slow."""
    model = LatencyModel()
    for step in range(40):
        now = step * 0.05
        for address, tpot in ((A, 0.012), (B, 0.012), (C, 0.024)):
            prefill = 300.0 + 100 * (step % 5)
            model.learn_ttft(address, ttft_features(prefill, 0.0), 0.02 + prefill / 5e4, now)
            model.learn_tpot(address, tpot_features(13 + step % 4), tpot, now, 60)
        model.refresh(now)
    assert spread(model) == pytest.approx(2.0, rel=0.15)
