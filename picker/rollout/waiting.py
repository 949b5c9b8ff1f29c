"""Why a canary gate waits: the evidence it needs, what the window holds, and whether this step can
ever gather it at this weight and rate.

A gate with fewer than `rollout.min_samples` in either group's window waits. At 10 % of 27 requests
a second, a 3 s window holds about 8 candidate samples: a gate that needs 10 waits for ever, and an
operator who sees only `wait` cannot tell it from a canary that is about to move. So each waiting
gate says how many samples it needs and has, the rate that would fill the window, and the time left
in the step. Pure: figures in, a reason out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from picker.rollout.gates import Reading


@dataclass(frozen=True, slots=True)
class Step:
    """The step's figures a reason needs."""

    weight: float  # percent of new requests to the candidate
    window_s: float
    min_samples: int
    rate_per_s: float  # requests ending per second, both groups (the windows' samples / their span)
    step_left_s: float  # until the step's interval has run (it then ends once every gate passes)


def reason(reading: Reading, step: Step) -> dict[str, Any] | None:
    """Why `reading` waits (None when it does not)."""
    if reading.verdict != "wait":
        return None
    need = step.min_samples
    has_c, has_s = reading.samples
    share = {"candidate": step.weight / 100, "stable": 1 - step.weight / 100}
    short = [side for side, has in (("candidate", has_c), ("stable", has_s)) if has < need]
    expected = {side: step.rate_per_s * step.window_s * share[side] for side in share}
    side = min(short, key=lambda s: expected[s]) if short else "candidate"
    fills = expected[side] >= need
    needed = need / (step.window_s * share[side]) if share[side] > 0 else float("inf")
    has = has_c if side == "candidate" else has_s
    text = f"{side} has {has} of {need} samples in the last {step.window_s:g} s"
    if fills:
        text += f"; at {step.rate_per_s:.1f} req/s the window fills (about {expected[side]:.0f})"
    else:
        text += (
            f"; at {step.weight:g} % of {step.rate_per_s:.1f} req/s a window holds about "
            f"{expected[side]:.0f}: it needs {needed:.1f} req/s, a longer rollout.window_s or a lower "
            "rollout.min_samples"
        )
    return {
        "needs": need,
        "has": [has_c, has_s],
        "short_side": side,
        "window_s": step.window_s,
        "weight": step.weight,
        "rate_per_s": round(step.rate_per_s, 2),
        "rate_needed_per_s": None if needed == float("inf") else round(needed, 2),
        "expected_in_window": round(expected[side], 1),
        "can_gather": fills,
        "step_left_s": round(max(0.0, step.step_left_s), 1),
        "text": text,
    }
