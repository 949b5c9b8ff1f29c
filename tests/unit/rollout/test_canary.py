"""The canary's rule (picker/rollout): the split, the gates, the steps and the rollback, on a fake clock."""

from __future__ import annotations

import pytest

from picker.config.model import RolloutConfig, steps_of
from picker.rollout import CANDIDATE, STABLE, Canary, CanaryPlan, Limits, Sample
from picker.rollout.gates import judge

LABEL = "app.kubernetes.io/version"


def plan(**changes: object) -> CanaryPlan:
    settings: dict[str, object] = {
        "group_label": LABEL,
        "stable": "v1",
        "candidate": "v2",
        "steps": (5, 25, 50, 100),
        "step_interval_s": 10.0,
        "window_s": 5.0,
        "min_samples": 10,
    }
    settings.update(changes)
    return CanaryPlan.of(RolloutConfig.model_validate(settings))


def good(at: float, ttft: float = 0.02) -> Sample:
    return Sample(at, cut=False, error=False, ttft_s=ttft, itl_s=0.01)


def feed(
    canary: Canary, start: float, seconds: float, candidate_ttft: float = 0.02, cut_every: int = 0
) -> float:
    """Ten requests a second per group, for `seconds`; the time reached."""
    at, n = start, 0
    while at < start + seconds:
        n += 1
        canary.ended(STABLE, good(at))
        cut = bool(cut_every) and n % cut_every == 0
        canary.ended(CANDIDATE, Sample(at, cut=cut, error=False, ttft_s=candidate_ttft, itl_s=0.01))
        at += 0.1
    return at


def test_the_split_gives_the_weight_exactly_over_any_run() -> None:
    for weight in (5, 25, 50):
        canary = Canary(plan(steps=(weight, 100)), 0.0)
        groups = [canary.assign() for _ in range(1000)]
        assert abs(groups.count(CANDIDATE) - weight * 10) <= 1


def test_an_endpoint_is_candidate_only_by_its_label() -> None:
    canary = Canary(plan(), 0.0)
    assert canary.group_of({LABEL: "v2"}) == CANDIDATE
    assert canary.group_of({LABEL: "v1"}) == STABLE
    assert canary.group_of({}) == STABLE and canary.group_of(None) == STABLE


def test_a_good_candidate_steps_through_every_weight_and_is_promoted() -> None:
    canary = Canary(plan(), 0.0)
    now, weights = 0.0, [canary.weight]
    while canary.phase == "progressing" and now < 100:
        now = feed(canary, now, 1.0)
        canary.tick(now, ["10.0.0.9:8000"])
        if canary.weight != weights[-1]:
            weights.append(canary.weight)
    assert weights == [5, 25, 50, 100] and canary.phase == "promoted"
    assert [e["event"] for e in canary.history].count("step-ended") == 3


def test_three_times_the_ttft_rolls_back_at_once_and_drains_the_candidate() -> None:
    canary = Canary(plan(), 0.0)
    now = feed(canary, 0.0, 1.2, candidate_ttft=0.06)
    actions = canary.tick(now, ["10.0.0.9:8000"])
    assert canary.phase == "rolled-back" and canary.weight == 0
    assert actions.drain == ["10.0.0.9:8000"]
    assert canary.rollback is not None and canary.rollback["reason"] == "gate ttft-p95 failed"
    ttft = next(g for g in canary.rollback["gates"] if g["gate"] == "ttft-p95")
    assert ttft["candidate"] == pytest.approx(0.06) and ttft["stable"] == pytest.approx(0.02)
    assert all(canary.assign() == STABLE for _ in range(100))
    assert canary.tick(now + 1, ["10.0.0.9:8000"]).drain == []  # once


def test_five_percent_truncated_streams_fail_the_cut_gate() -> None:
    canary = Canary(plan(min_samples=20), 0.0)
    now = feed(canary, 0.0, 4.0, cut_every=20)
    canary.tick(now, [])
    assert canary.phase == "rolled-back" and canary.rollback["reason"] == "gate cut-rate failed"  # type: ignore[index]


def test_gates_wait_for_samples_and_a_step_waits_for_them() -> None:
    canary = Canary(plan(), 0.0)
    canary.ended(CANDIDATE, good(0.0, ttft=9.0))
    canary.tick(20.0, [])  # past the interval, but one sample: nothing judged, no step
    assert canary.phase == "progressing" and canary.weight == 5
    assert {r.verdict for r in canary.readings} == {"wait"}


def test_samples_leave_the_window() -> None:
    canary = Canary(plan(), 0.0)
    feed(canary, 0.0, 2.0, candidate_ttft=1.0)
    canary.tick(30.0, [])  # the bad samples are 28 s old: out of a 5 s window
    assert canary.phase == "progressing"


def test_abort_resume_pause_and_promote_by_hand() -> None:
    canary = Canary(plan(), 0.0)
    assert canary.abort(1.0, ["a:1"]).drain == ["a:1"] and canary.phase == "rolled-back"
    actions = canary.resume(2.0)
    assert actions.undrain == ["a:1"] and canary.phase == "progressing" and canary.weight == 5
    canary.pause(3.0)
    assert canary.phase == "paused" and canary.tick(100.0, []).drain == []
    canary.resume(4.0)
    canary.promote(5.0)
    assert canary.phase == "promoted" and canary.weight == 100 and canary.assign() == CANDIDATE


def test_stable_truncating_too_does_not_blame_the_candidate() -> None:
    stable = [Sample(0, cut=i % 10 == 0, error=False, ttft_s=0.02, itl_s=0.01) for i in range(100)]
    candidate = [Sample(0, cut=i % 10 == 0, error=False, ttft_s=0.02, itl_s=0.01) for i in range(100)]
    assert {r.verdict for r in judge(candidate, stable, Limits.of(RolloutConfig()))} == {"pass"}


def test_steps_are_checked() -> None:
    assert steps_of("5,25,50,100") == (5, 25, 50, 100)
    for bad in ("5,25", "50,25,100", "0,100", ""):
        with pytest.raises(ValueError):
            steps_of(bad)


# --- gates from whatever the shape shows (issue 41) -----------------------------------------------


def headers_only(at: float, error: bool = False) -> Sample:
    """What a gateway that shows the picker response headers alone gives: the status, nothing else."""
    return Sample(at, cut=None, error=error, ttft_s=None, itl_s=None)


def feed_headers_only(canary: Canary, start: float, seconds: float, candidate_errors: bool = False) -> float:
    at = start
    while at < start + seconds:
        canary.ended(STABLE, headers_only(at))
        canary.ended(CANDIDATE, headers_only(at, error=candidate_errors))
        at += 0.1
    return at


def test_a_gate_no_sample_can_feed_says_so_and_holds_nothing() -> None:
    canary = Canary(plan(step_interval_s=1.0), 0.0)
    now = feed_headers_only(canary, 0.0, 1.5)
    canary.routed = {CANDIDATE: 5, STABLE: 95}
    canary.tick(now, [])
    verdicts = {r.gate: r.verdict for r in canary.readings}
    assert verdicts == {
        "cut-rate": "unobservable",
        "5xx-before-first-byte": "pass",
        "ttft-p95": "unobservable",
        "itl-p95": "unobservable",
    }
    assert canary.weight == 25  # the step ended on the gate that can judge
    shown = {g["gate"]: g for g in canary.status(now)["gates"]}
    assert "not observable here" in shown["ttft-p95"]["note"]
    assert "first token" in shown["ttft-p95"]["judges_from"] and "note" not in shown["5xx-before-first-byte"]


def test_a_5xx_candidate_behind_a_headers_only_gateway_is_rolled_back() -> None:
    canary = Canary(plan(), 0.0)
    now = feed_headers_only(canary, 0.0, 1.2, candidate_errors=True)
    canary.tick(now, ["10.0.0.9:8000"])
    assert canary.phase == "rolled-back"
    assert canary.rollback is not None and canary.rollback["reason"] == "gate 5xx-before-first-byte failed"


def test_too_few_samples_is_a_wait_not_unobservable() -> None:
    canary = Canary(plan(), 0.0)
    for i in range(5):  # half the minimum
        canary.ended(CANDIDATE, headers_only(i * 0.1))
        canary.ended(STABLE, headers_only(i * 0.1))
    canary.tick(1.0, [])
    assert {r.verdict for r in canary.readings} == {"wait"}


def test_non_streamed_requests_feed_every_gate_but_itl_and_the_steps_go_on() -> None:
    canary = Canary(plan(step_interval_s=1.0), 0.0)
    at = 0.0
    while at < 1.5:
        for group in (STABLE, CANDIDATE):
            canary.ended(group, Sample(at, cut=False, error=False, ttft_s=0.05, itl_s=None))
        at += 0.1
    canary.routed = {CANDIDATE: 5, STABLE: 95}
    canary.tick(at, [])
    assert {r.gate: r.verdict for r in canary.readings}["itl-p95"] == "unobservable"
    assert canary.weight == 25


def test_with_nothing_to_judge_no_step_ends() -> None:
    canary = Canary(plan(step_interval_s=1.0), 0.0)
    at = 0.0
    while at < 1.5:
        for group in (STABLE, CANDIDATE):
            canary.ended(group, Sample(at, cut=None, error=None, ttft_s=None, itl_s=None))
        at += 0.1
    canary.routed = {CANDIDATE: 5, STABLE: 95}
    canary.tick(at, [])
    assert {r.verdict for r in canary.readings} == {"unobservable"} and canary.weight == 5


def test_rollout_status_says_what_each_gate_judges_from_and_which_cannot() -> None:
    from picker.rollout.command import describe

    canary = Canary(plan(step_interval_s=1.0), 0.0)
    now = feed_headers_only(canary, 0.0, 1.5)
    canary.tick(now, [])
    text = describe(canary.status(now))
    assert "ttft-p95               not observable here: add the observer filter" in text
    assert "5xx-before-first-byte  pass" in text
    assert "what each gate judges from:" in text and "the response status" in text
