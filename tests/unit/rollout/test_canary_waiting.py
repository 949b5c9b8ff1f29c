"""A canary gate that waits says why (issue 54, item 4): picker/rollout/waiting.py and Canary.gates.

The issue's case: a canary at 10 % whose gates need 10 samples in a 3 s window, under 27 requests a
second, showed `wait` for 16 s with no reason (8 samples per window were all it could get).
"""

from __future__ import annotations

import logging

import pytest

from picker.config.model import RolloutConfig
from picker.rollout import CANDIDATE, STABLE, Canary, CanaryPlan, Sample
from picker.rollout.command import describe


def canary_at(rate_per_s: float, seconds: float, min_samples: int = 10) -> tuple[Canary, float]:
    """A canary at its first step (10 %) fed `rate_per_s` ended requests, 10 % of them the candidate's."""
    config = RolloutConfig(candidate="v2", steps=(10, 50, 100), window_s=3.0, min_samples=min_samples,
                           step_interval_s=5.0)  # fmt: skip
    canary = Canary(CanaryPlan.of(config), 0.0)
    count = int(rate_per_s * seconds)
    for i in range(count):
        at = i / rate_per_s
        group = CANDIDATE if i % 10 == 0 else STABLE
        canary.ended(group, Sample(at, False, False, 0.1, 0.01))
    now = count / rate_per_s
    canary.tick(now, [])
    return canary, now


def test_a_gate_that_cannot_gather_its_samples_says_so_with_the_rate_it_needs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="picker.rollout.canary")
    canary, now = canary_at(27.0, 16.0)
    gates = canary.status(now)["gates"]
    assert gates and all(g["verdict"] == "wait" for g in gates)
    why = gates[0]["why"]
    assert why["needs"] == 10 and why["has"][0] == 8 and why["short_side"] == "candidate"
    assert why["can_gather"] is False and why["rate_needed_per_s"] == pytest.approx(33.33, abs=0.01)
    assert "needs 33.3 req/s" in why["text"] and "rollout.window_s" in why["text"]
    assert "cannot gather" in describe(canary.status(now))
    said = [r for r in caplog.records if "cannot gather its samples" in r.getMessage()]
    canary.tick(now + 0.5, [])
    assert len([r for r in caplog.records if "cannot gather its samples" in r.getMessage()]) == len(said) == 1


def test_a_gate_whose_window_will_fill_says_it_waits_for_evidence_that_comes() -> None:
    canary, now = canary_at(40.0, 2.0)
    why = canary.status(now)["gates"][0]["why"]
    assert why["can_gather"] is True and "the window fills" in why["text"]
    assert why["step_left_s"] == pytest.approx(3.0, abs=0.1)


def test_a_gate_that_judges_says_no_why() -> None:
    canary, now = canary_at(100.0, 3.0, min_samples=5)
    assert all("why" not in g for g in canary.status(now)["gates"] if g["verdict"] != "wait")
