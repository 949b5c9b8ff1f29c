"""Canary gates: each group's figures over a sliding window, and the candidate judged against stable.

A request, at its end, leaves one `Sample` for the group that served it. Gates compare the
candidate's figures with the stable group's over the same window, as ratios with a floor (a
stable group that truncated nothing must not make one candidate truncation fail the rollout):
- truncation + cut rate (ended after the commit point without completing: truncated, error event,
  stalled);
- 5xx before the first byte;
- TTFT p95 and ITL p95 (a request's mean gap between chunks).
A gate with fewer than `min_samples` in either group waits. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from picker.config import RolloutConfig
from picker.streams import EndReason

CUT = frozenset({EndReason.UPSTREAM_TRUNCATED, EndReason.UPSTREAM_ERROR_EVENT, EndReason.STALLED})


class Sample(NamedTuple):
    """What one ended request says about its group (a tuple: one is made per request)."""

    at: float
    cut: bool  # ended after its first token without completing
    error: bool  # 5xx before its first byte
    ttft_s: float | None
    itl_s: float | None


@dataclass(frozen=True, slots=True)
class Limits:
    """The gates' thresholds (their defaults and meaning: the config model's RolloutConfig)."""

    min_samples: int
    cut_ratio: float
    cut_floor: float  # a candidate rate at or below this always passes
    error_ratio: float
    error_floor: float
    ttft_ratio: float
    itl_ratio: float
    latency_floor_s: float  # a p95 this little above stable's always passes

    @classmethod
    def of(cls, config: RolloutConfig) -> Limits:
        return cls(
            min_samples=config.min_samples,
            cut_ratio=config.cut_ratio,
            cut_floor=config.cut_floor,
            error_ratio=config.error_ratio,
            error_floor=config.error_floor,
            ttft_ratio=config.ttft_ratio,
            itl_ratio=config.itl_ratio,
            latency_floor_s=config.latency_floor_s,
        )


@dataclass(frozen=True, slots=True)
class Reading:
    """One gate's reading: both groups' figures, the limit the candidate's must not exceed, and
    `verdict` "pass", "fail" or "wait" (too few samples)."""

    gate: str
    candidate: float | None
    stable: float | None
    limit: float | None
    samples: tuple[int, int]  # (candidate, stable)
    verdict: str

    def as_dict(self) -> dict[str, object]:
        def r(value: float | None) -> float | None:
            return None if value is None else round(value, 4)

        return {
            "gate": self.gate,
            "candidate": r(self.candidate),
            "stable": r(self.stable),
            "limit": r(self.limit),
            "samples": list(self.samples),
            "verdict": self.verdict,
        }


class Window:
    """One group's samples of the last `span_s` seconds."""

    def __init__(self, span_s: float) -> None:
        self.span_s = span_s
        self._samples: deque[Sample] = deque()

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: Sample) -> None:
        self._samples.append(sample)

    def prune(self, now: float) -> None:
        cutoff = now - self.span_s
        samples = self._samples
        while samples and samples[0].at < cutoff:
            samples.popleft()

    def clear(self) -> None:
        self._samples.clear()

    def samples(self) -> Sequence[Sample]:
        return tuple(self._samples)


def p95(values: Sequence[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _rate(
    gate: str, cand: Sequence[bool], stab: Sequence[bool], ratio: float, floor: float, least: int
) -> Reading:
    counts = (len(cand), len(stab))
    if min(counts) < least:
        return Reading(gate, None, None, None, counts, "wait")
    c, s = sum(cand) / len(cand), sum(stab) / len(stab)
    limit = max(s * ratio, floor)
    return Reading(gate, c, s, limit, counts, "fail" if c > limit else "pass")


def _latency(
    gate: str, cand: Sequence[float], stab: Sequence[float], ratio: float, floor_s: float, least: int
) -> Reading:
    counts = (len(cand), len(stab))
    c, s = p95(cand), p95(stab)
    if min(counts) < least or c is None or s is None:
        return Reading(gate, c, s, None, counts, "wait")
    limit = max(s * ratio, s + floor_s)
    return Reading(gate, c, s, limit, counts, "fail" if c > limit else "pass")


def judge(candidate: Sequence[Sample], stable: Sequence[Sample], limits: Limits) -> list[Reading]:
    """Every gate's reading for the candidate against stable over the same window."""
    least = limits.min_samples
    return [
        _rate(
            "cut-rate",
            [s.cut for s in candidate],
            [s.cut for s in stable],
            limits.cut_ratio,
            limits.cut_floor,
            least,
        ),
        _rate(
            "5xx-before-first-byte",
            [s.error for s in candidate],
            [s.error for s in stable],
            limits.error_ratio,
            limits.error_floor,
            least,
        ),
        _latency(
            "ttft-p95",
            [s.ttft_s for s in candidate if s.ttft_s is not None],
            [s.ttft_s for s in stable if s.ttft_s is not None],
            limits.ttft_ratio,
            limits.latency_floor_s,
            least,
        ),
        _latency(
            "itl-p95",
            [s.itl_s for s in candidate if s.itl_s is not None],
            [s.itl_s for s in stable if s.itl_s is not None],
            limits.itl_ratio,
            limits.latency_floor_s,
            least,
        ),
    ]
