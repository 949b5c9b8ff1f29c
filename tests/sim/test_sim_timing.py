"""The latency model: absolute deadlines, bounded jitter, determinism, overrides; tokens never early.

Accuracy (how late tokens are under load) is measured by loadtest/bench_sim.py, not asserted here.
"""

from __future__ import annotations

import asyncio

import parity_checks as pc
import pytest
from simkit import fast_config
from vllm_sim import LatencyConfig, run_sim
from vllm_sim.timing import Overrides, parse_overrides, plan_tokens

from loadtest import http_client
from loadtest.sse_client import stream_request

EARLY_TOLERANCE_S = 0.002  # timer granularity


def test_deadlines_are_absolute_and_do_not_accumulate() -> None:
    plan = plan_tokens(LatencyConfig(itl_ms=7), "k", 10, 1000, True, Overrides())
    deadlines = [plan.deadline(100.0, index) for index in range(1000)]
    assert deadlines == [100.0 + index * 0.007 for index in range(1000)]


def test_jitter_is_bounded_and_never_accumulates() -> None:
    plan = plan_tokens(LatencyConfig(itl_ms=10, itl_jitter_ms=3), "k", 10, 1000, True, Overrides())
    offsets = [plan.deadline(0.0, index) - index * 0.010 for index in range(1, 1000)]
    assert all(abs(offset) <= 0.003 + 1e-12 for offset in offsets)
    assert max(offsets) > 0.002 and min(offsets) < -0.002  # it does jitter


def test_ttft_grows_with_the_prompt_and_jitter_stays_bounded() -> None:
    latency = LatencyConfig(ttft_ms=20, ttft_per_prompt_token_ms=0.5, ttft_jitter_ms=5)
    ttfts = [plan_tokens(latency, str(k), 100, 10, True, Overrides()).ttft_s for k in range(200)]
    assert all(0.065 <= t <= 0.075 for t in ttfts) and len(set(ttfts)) > 100


def test_plans_are_deterministic_per_seed_and_key() -> None:
    latency = LatencyConfig(eos_rate=0.5, itl_jitter_ms=2, seed=3)

    def summary(key: str, seed_latency: LatencyConfig = latency) -> tuple[int, str, list[float]]:
        plan = plan_tokens(seed_latency, key, 10, 100, False, Overrides())
        return plan.output_tokens, plan.finish_reason, [plan.deadline(0, i) for i in range(5)]

    assert summary("a") == summary("a")
    keys = [summary(str(k)) for k in range(50)]
    assert {reason for _, reason, _ in keys} == {"stop", "length"}
    other_seed = LatencyConfig(eos_rate=0.5, itl_jitter_ms=2, seed=4)
    assert [summary(str(k), other_seed) for k in range(50)] != keys


def test_overrides() -> None:
    overrides = parse_overrides({"x-sim-ttft-ms": "250", "x-sim-itl-ms": "0", "x-sim-max-tokens": "3"})
    plan = plan_tokens(LatencyConfig(eos_rate=1.0), "k", 10, 100, False, overrides)
    assert (plan.ttft_s, plan.itl_s, plan.output_tokens, plan.finish_reason) == (0.25, 0.0, 3, "length")


async def test_tokens_never_arrive_before_their_deadline() -> None:
    async with run_sim(fast_config(latency=LatencyConfig(ttft_ms=30, itl_ms=15))) as (replica,):
        async with http_client.AsyncClient(base_url=replica.url) as http:
            body = {"prompt": "x", "max_tokens": 12, "ignore_eos": True, "stream": True}
            result = await stream_request(http, "/v1/completions", body)
            overridden = await stream_request(
                http, "/v1/completions", body, headers={"x-sim-ttft-ms": "80", "x-sim-itl-ms": "5"}
            )
    for index, event in enumerate(result.events[:12]):
        assert event.at >= 0.030 + index * 0.015 - EARLY_TOLERANCE_S, (index, event.at)
    assert overridden.ttft is not None and overridden.ttft >= 0.080 - EARLY_TOLERANCE_S
    assert overridden.events[11].at >= 0.080 + 11 * 0.005 - EARLY_TOLERANCE_S


async def test_a_replica_slowed_down_mid_run_stretches_every_duration() -> None:
    """POST /sim/speed: what a replica that turns slow (a noisy neighbour, a throttled GPU) does."""
    async with run_sim(fast_config(latency=LatencyConfig(ttft_ms=20, itl_ms=5))) as (replica,):
        async with http_client.AsyncClient(base_url=replica.url) as http:
            body = {"prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": True}
            before = await stream_request(http, "/v1/completions", body)
            slowed = await http.post("/sim/speed", json={"slowdown": 3})
            assert slowed.status_code == 200 and (await http.get("/sim/speed")).json() == {"slowdown": 3.0}
            after = await stream_request(http, "/v1/completions", body)
            refused = await http.post("/sim/speed", json={"slowdown": "fast"})
    assert refused.status_code == 400
    assert after.ttft is not None and after.ttft >= 3 * 0.020 - EARLY_TOLERANCE_S
    assert after.events[9].at >= 3 * (0.020 + 9 * 0.005) - EARLY_TOLERANCE_S
    assert before.events[9].at < after.events[9].at


async def test_each_other_running_request_slows_every_next_token() -> None:
    """--itl-per-running-ms: a batch that grows makes every step longer, as a real engine's does
    (vLLM 0.32 on CPU, tiny model: 1.4 ms per token alone, 2.5 ms with six decoding). The cost per
    other request is large here (100 ms a step) so the two cases differ by most of a second, far
    beyond a busy machine's timer noise."""
    latency = LatencyConfig(ttft_ms=5, itl_ms=5, itl_per_running_ms=100)
    async with run_sim(fast_config(latency=latency)) as (replica,):
        async with http_client.AsyncClient(base_url=replica.url) as http:
            body = {"prompt": "x", "max_tokens": 6, "ignore_eos": True, "stream": True}
            alone = await stream_request(http, "/v1/completions", body)
            long_body = {**body, "max_tokens": 12}  # still decoding while the next one runs
            crowd = [
                asyncio.create_task(stream_request(http, "/v1/completions", long_body)) for _ in range(2)
            ]
            assert await pc.wait_until(lambda: len(replica.state.engine.running) == 2, 5)
            beside = await stream_request(http, "/v1/completions", body)
            await asyncio.gather(*crowd)
    # alone, nothing is added (5 steps of 5 ms; counting itself would make them 105 ms each)
    assert alone.events[5].at - alone.events[0].at < 0.3
    # two others running: each step 5 + 2 x 100 ms
    assert beside.events[5].at - beside.events[0].at >= 5 * 0.205 - EARLY_TOLERANCE_S


def test_the_step_grows_with_the_batch_and_with_a_slowdown() -> None:
    plan = plan_tokens(LatencyConfig(itl_ms=10, itl_per_running_ms=2), "k", 10, 100, True, Overrides())
    assert plan.step_s(1) == 0.010
    assert abs(plan.step_s(4) - 0.016) < 1e-12
    with pytest.raises(ValueError, match="itl_per_running_ms"):
        LatencyConfig(itl_per_running_ms=-1)
