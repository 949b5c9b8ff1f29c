"""Canary gates behind the gateways users run (issue 41): through the real Envoy with Envoy Gateway's
generated shape (routing ext_proc with request headers, a buffered body and response headers; no
observer filter, no access log), then the same with Envoy's gRPC access log to the picker.

Before, every gate waited for samples that shape never gives: a candidate answering 500 to everything
was never rolled back, a good one never promoted. Now each gate judges from what the shape shows
(the status from response headers; stream ends from the access log's flags) and a gate that cannot
judge says so and holds nothing. The observer and proxy shapes: tests/frontends/test_canary.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from loadtest.rollout.canary import STABLE_SIM, CanaryStack
from loadtest.traffic import run_closed_loop

pytestmark = pytest.mark.envoy

GATEWAY: dict[str, Any] = {"shape": "eg-buffered", "envoy_picker_tls": False}
WITH_ACCESS_LOG: dict[str, Any] = {**GATEWAY, "picker_access_log": True}
WINDOW_S = 3.0


async def _rolled_back(
    canary: CanaryStack, requests: int = 1500
) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    canary.start()
    try:
        traffic = asyncio.create_task(
            run_closed_loop(
                canary.stack.url, concurrency=12, max_requests=requests, deadline_s=30, max_tokens=4
            )
        )
        status = await canary.until_phase("rolled-back", traffic, 25)
        await traffic
        log = canary.stack.sim_requests(canary.candidate)
        routed = canary.stack.picker_value("picker_rollout_routed_total", group="candidate")
    finally:
        canary.stop()
    return status, log, routed


def _nothing_after(status: dict[str, Any], log: list[dict[str, Any]], routed: float) -> float:
    """When the rollback was; asserts no request reached the candidate after it, counted rather
    than timed (a request picked just before it can reach the candidate's engine well after it on
    a loaded machine): the picker routed it none since, and its engine saw no other."""
    rolled_back_at = status["rollback"]["at_s"] + status["clock_to_wall_s"]
    before = sum(e["routed"]["candidate"] for e in status["history"] if e["event"] == "step-ended")
    assert routed == before, (routed, status["history"])
    assert len(log) == before, (len(log), before)
    assert status["weight"] == 0
    return float(rolled_back_at)


async def test_a_5xx_candidate_is_rolled_back_from_response_headers_alone(tmp_path: Path) -> None:
    rollout = {"steps": [5, 25, 50, 100], "window_s": WINDOW_S, "min_samples": 10}
    canary = CanaryStack(tmp_path, "envoy", (*STABLE_SIM, "--fault", "status=500"), rollout, GATEWAY)
    status, log, routed = await _rolled_back(canary)
    assert status["rollback"]["reason"] == "gate 5xx-before-first-byte failed", status["rollback"]
    rolled_back_at = _nothing_after(status, log, routed)
    first_500 = min(r["arrival"] for r in log)
    assert rolled_back_at - first_500 <= 2 * WINDOW_S, (rolled_back_at, first_500)
    gates = {g["gate"]: g for g in status["rollback"]["gates"]}
    assert gates["ttft-p95"]["verdict"] == "unobservable"  # no first token behind this gateway
    assert "not observable here" in gates["ttft-p95"]["note"]


async def test_a_good_candidate_is_promoted_through_every_step(tmp_path: Path) -> None:
    rollout = {
        "steps": [10, 50, 100],
        "step_interval_s": 0.5,
        "step_min_requests": 300,
        "window_s": 5,
        "min_samples": 10,
    }
    canary = CanaryStack(tmp_path, "envoy", STABLE_SIM, rollout, GATEWAY)
    canary.start()
    try:
        traffic = asyncio.create_task(
            run_closed_loop(canary.stack.url, concurrency=12, max_requests=2500, deadline_s=50, max_tokens=4)
        )
        status = await canary.until_phase("promoted", traffic, 45)
        report = await traffic
    finally:
        canary.stop()
    steps = [e for e in status["history"] if e["event"] == "step-ended"]
    assert [s["weight"] for s in steps] == [10, 50]
    for step in steps:  # each step ended on the gate that could judge, the others said so
        verdicts = {g["gate"]: g["verdict"] for g in step["gates"]}
        assert verdicts["5xx-before-first-byte"] == "pass", verdicts
        assert verdicts["ttft-p95"] == verdicts["itl-p95"] == verdicts["cut-rate"] == "unobservable"
    assert report.failures() == [], report.failures()[:3]


async def test_with_the_access_log_a_candidate_that_cuts_streams_is_rolled_back_on_the_cut_gate(
    tmp_path: Path,
) -> None:
    rollout = {"steps": [5, 25, 50, 100], "window_s": WINDOW_S, "min_samples": 10}
    candidate = (*STABLE_SIM, "--fault", "reset-after=2")  # every stream reset after 2 of its 4 tokens
    canary = CanaryStack(tmp_path, "envoy", candidate, rollout, WITH_ACCESS_LOG)
    status, log, routed = await _rolled_back(canary)
    assert status["rollback"]["reason"] == "gate cut-rate failed", status["rollback"]
    _nothing_after(status, log, routed)
    cut = next(g for g in status["rollback"]["gates"] if g["gate"] == "cut-rate")
    assert cut["candidate"] > cut["limit"], cut
