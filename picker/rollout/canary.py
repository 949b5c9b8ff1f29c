"""The canary: a candidate group gets `weight` % of new requests, in steps, while its gates pass.

States: `progressing` (gates judged on every tick; a step ends after `step_interval_s` and at least
`step_min_requests` routed in it, if every gate that can judge here passes), `promoted` (the step before 100
passed: every new request to the candidate), `rolled-back` (a gate failed, or `abort`: weight 0,
the candidate's endpoints to be drained; its streams run to their end), `paused` (by hand). What
the frontends must do about it comes back from `tick` as addresses to drain or undrain.

The split is a credit counter, not a coin: over any N requests the candidate gets weight x N / 100
of them, give or take one. Pure: the caller passes the clock.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from picker.config.model import RolloutConfig
from picker.rollout.evidence import sample_of
from picker.rollout.gates import Limits, Reading, Sample, Window, judge, step_may_end
from picker.rollout.waiting import Step, reason
from picker.streams import EndReason, RequestRecord

log = logging.getLogger(__name__)

CANDIDATE, STABLE = "candidate", "stable"
PHASES = ("progressing", "paused", "promoted", "rolled-back")


@dataclass(frozen=True, slots=True)
class CanaryPlan:
    """What the operator configured (rollout.* in the config; its defaults are the config model's)."""

    label: str
    stable: str
    candidate: str
    steps: tuple[int, ...]
    step_interval_s: float
    step_min_requests: int
    window_s: float
    limits: Limits

    @property
    def rollout_id(self) -> str:
        """The same on every picker and across restarts (`<label>=<candidate>`): the cause its
        rollback's drains carry in the shared drain record, so its `resume` lifts those only."""
        return f"{self.label}={self.candidate}"

    @classmethod
    def of(cls, config: RolloutConfig) -> CanaryPlan:
        if config.candidate is None:
            raise ValueError("a canary needs rollout.candidate")
        return cls(
            config.group_label,
            config.stable or "",
            config.candidate,
            config.steps,
            config.step_interval_s,
            config.step_min_requests,
            config.window_s,
            Limits.of(config),
        )


@dataclass(slots=True)
class Actions:
    """What a tick asks of the frontend: drain or undrain these endpoints (through the admin store)."""

    drain: list[str] = field(default_factory=list)
    undrain: list[str] = field(default_factory=list)


class Canary:
    """One rollout's state, split and gates."""

    def __init__(self, plan: CanaryPlan, now: float) -> None:
        self.plan = plan
        self.phase = "progressing"
        self.step = 0
        self.weight = plan.steps[0] if plan.steps else 100
        self.step_started_at = now
        self.routed = {CANDIDATE: 0, STABLE: 0}  # requests routed in this step, per group
        self.windows = {CANDIDATE: Window(plan.window_s), STABLE: Window(plan.window_s)}
        self.readings: list[Reading] = []
        self.rollback: dict[str, Any] | None = None
        self.history: deque[dict[str, Any]] = deque(maxlen=64)
        self.drained: list[str] = []  # candidate endpoints this rollout drained (resume lifts them)
        self._credit = 0.0
        self.events = 0  # decisions taken so far (the history keeps the last 64)
        self.rollbacks = 0
        self.totals = {CANDIDATE: 0, STABLE: 0}  # requests routed to each group, ever
        self._stuck_said: tuple[int, float] | None = None  # the step whose stuck wait was logged
        self._event(now, "started", weight=self.weight)

    # -- routing -----------------------------------------------------------------------------
    def group_of(self, labels: Mapping[str, str] | None) -> str:
        """The side an endpoint is on: the candidate's label value, or stable (anything else)."""
        if labels is not None and labels.get(self.plan.label) == self.plan.candidate:
            return CANDIDATE
        return STABLE

    def assign(self) -> str:
        """The group of the next new request."""
        if self.weight <= 0:
            return STABLE
        if self.weight >= 100:
            return CANDIDATE
        self._credit += self.weight / 100.0
        if self._credit >= 1.0:
            self._credit -= 1.0
            return CANDIDATE
        return STABLE

    def routed_to(self, group: str) -> None:
        self.routed[group] += 1
        self.totals[group] += 1

    def ended(self, group: str, sample: Sample) -> None:
        self.windows[group].add(sample)

    def request_ended(
        self, record: RequestRecord, reason: EndReason, now: float, where: Labelled | None
    ) -> None:
        """What an ended request says about the group of `where`, the endpoint that served it (a
        fallback may have moved it off the group it was sent to); its own group when forgotten."""
        sample = sample_of(record, reason, now)
        if sample is not None:
            self.ended(self.group_of(where.labels) if where is not None else record.group or STABLE, sample)

    # -- the control loop --------------------------------------------------------------------
    def tick(self, now: float, candidates: Iterable[str]) -> Actions:
        """Judge the gates; step, promote or roll back. `candidates`: the candidate group's
        endpoints now (what a rollback drains)."""
        for window in self.windows.values():
            window.prune(now)
        actions = Actions()
        if self.phase != "progressing":
            return actions
        self.readings = judge(
            self.windows[CANDIDATE].samples(), self.windows[STABLE].samples(), self.plan.limits
        )
        failed = [r for r in self.readings if r.verdict == "fail"]
        if failed:
            return self._roll_back(now, candidates, f"gate {failed[0].gate} failed")
        self._say_if_stuck(now)
        if (
            now - self.step_started_at >= self.plan.step_interval_s
            and sum(self.routed.values()) >= self.plan.step_min_requests
            and step_may_end(self.readings)
        ):
            self._next_step(now)
        return actions

    def promote(self, now: float) -> Actions:
        """By hand: every new request to the candidate from now on."""
        self._close_step(now)
        self.phase, self.weight, self.step = "promoted", 100, len(self.plan.steps) - 1
        self._event(now, "promoted", weight=100, by="hand")
        return Actions()

    def abort(self, now: float, candidates: Iterable[str]) -> Actions:
        """By hand: the same rollback a failed gate does."""
        return self._roll_back(now, candidates, "aborted by hand")

    def pause(self, now: float) -> None:
        if self.phase == "progressing":
            self.phase = "paused"
            self._event(now, "paused", weight=self.weight)

    def resume(self, now: float) -> Actions:
        """Paused: go on from the same step. Rolled back: start again from the first step, the
        candidate's endpoints undrained, the windows empty."""
        actions = Actions()
        if self.phase == "rolled-back":
            actions.undrain, self.drained = self.drained, []
            self.step, self.weight = 0, self.plan.steps[0] if self.plan.steps else 100
            for window in self.windows.values():
                window.clear()
            self.rollback = None
        elif self.phase != "paused":
            return actions
        self.phase = "progressing"
        self._start_step(now)
        self._event(now, "resumed", weight=self.weight)
        return actions

    # -- what it shows -----------------------------------------------------------------------
    def status(self, now: float) -> dict[str, Any]:
        plan = self.plan
        return {
            "phase": self.phase,
            "weight": self.weight,
            "step": self.step,
            "steps": list(plan.steps),
            "step_for_s": round(now - self.step_started_at, 3),
            "routed_this_step": dict(self.routed),
            "groups": {"label": plan.label, STABLE: plan.stable, CANDIDATE: plan.candidate},
            "window_s": plan.window_s,
            "gates": self.gates(now),
            "rollback": self.rollback,
            "history": list(self.history),
        }

    def gates(self, now: float) -> list[dict[str, Any]]:
        """Each gate's reading; a waiting one says why (picker/rollout/waiting.py)."""
        step = self.waiting_step(now)
        out = []
        for reading in self.readings:
            shown = reading.as_dict()
            why = reason(reading, step) if self.phase == "progressing" else None
            if why is not None:
                shown["why"] = why
            out.append(shown)
        return out

    def waiting_step(self, now: float) -> Step:
        plan = self.plan
        ended = sum(len(window) for window in self.windows.values())
        return Step(
            weight=self.weight,
            window_s=plan.window_s,
            min_samples=plan.limits.min_samples,
            rate_per_s=ended / span if (span := min(plan.window_s, now - self.step_started_at)) > 0 else 0.0,
            step_left_s=plan.step_interval_s - (now - self.step_started_at),
        )

    def _say_if_stuck(self, now: float) -> None:
        """Once per step, when a gate waits for samples its window cannot hold at this weight and
        rate (after a full window of traffic: before it, the rate is not known)."""
        if (
            self._stuck_said == (self.step, self.step_started_at)
            or now - self.step_started_at < self.plan.window_s
        ):
            return
        step = self.waiting_step(now)
        for reading in self.readings:
            why = reason(reading, step)
            if why is not None and not why["can_gather"]:
                self._stuck_said = (self.step, self.step_started_at)
                log.warning(
                    "canary step %d cannot gather its samples: gate %s: %s",
                    self.step,
                    reading.gate,
                    why["text"],
                )
                return

    # -- inside ------------------------------------------------------------------------------
    def _roll_back(self, now: float, candidates: Iterable[str], why: str) -> Actions:
        if self.phase == "rolled-back":
            return Actions()
        self._close_step(now)
        self.phase, self.weight = "rolled-back", 0
        self.rollbacks += 1
        readings = [r.as_dict() for r in self.readings]
        self.rollback = {
            "at_s": round(now, 3),
            "reason": why,
            "window_s": self.plan.window_s,
            "gates": readings,
        }
        self.drained = sorted(candidates)
        self._event(now, "rolled-back", weight=0, reason=why, drained=self.drained)
        return Actions(drain=list(self.drained))

    def _next_step(self, now: float) -> None:
        self._close_step(now)
        if self.step + 2 >= len(self.plan.steps):  # the step before the last passed: promote
            self.phase, self.weight, self.step = "promoted", 100, len(self.plan.steps) - 1
            self._event(now, "promoted", weight=100)
            return
        self.step += 1
        self.weight = self.plan.steps[self.step]
        self._start_step(now)
        self._event(now, "step", weight=self.weight)

    def _start_step(self, now: float) -> None:
        self.step_started_at = now
        self.routed = {CANDIDATE: 0, STABLE: 0}
        self._credit = 0.0

    def _close_step(self, now: float) -> None:
        """The step's measured share into the history (what the weight did)."""
        total = sum(self.routed.values())
        share = self.routed[CANDIDATE] / total if total else None
        self._event(
            now,
            "step-ended",
            weight=self.weight,
            routed=dict(self.routed),
            share=None if share is None else round(100 * share, 2),
            gates=[r.as_dict() for r in self.readings],
        )

    def _event(self, now: float, event: str, **fields: Any) -> None:
        self.history.append({"at_s": round(now, 3), "event": event, **fields})
        self.events += 1


class Labelled(Protocol):
    @property
    def labels(self) -> Mapping[str, str] | None: ...


E = TypeVar("E", bound=Labelled)


def canary_side(
    canary: Canary, group: str | None, home: Labelled | None, candidates: list[E]
) -> tuple[str, list[E]]:
    """A request's canary group and the candidates on its side: the group is chosen once (a
    session keeps the group of the endpoint it is bound to, `home`; the others by the weighted
    split), the other side only when its own has no ready endpoint that fits, and never the
    candidate at weight 0 (a request that waited through a rollback goes to the stable side)."""
    if group is None:
        group = canary.group_of(home.labels) if home is not None else canary.assign()
    if group == CANDIDATE and canary.weight <= 0:
        group = STABLE
    side = [e for e in candidates if canary.group_of(e.labels) == group]
    if side or not candidates:
        return group, side
    other = STABLE if group == CANDIDATE else CANDIDATE
    if other == CANDIDATE and canary.weight <= 0:
        return group, side
    return other, [e for e in candidates if canary.group_of(e.labels) == other]
