"""Canary gates: each group's figures over a sliding window, and the candidate judged against stable.

A request, at its end, leaves one `Sample` for the group that served it. Gates compare the
candidate's figures with the stable group's over the same window, as ratios with a floor (a
stable group that truncated nothing must not make one candidate truncation fail the rollout):
- truncation + cut rate (ended after the commit point without completing: truncated, error event,
  stalled);
- 5xx before the first byte;
- TTFT p95 and ITL p95 (a request's mean gap between chunks).
A gate with fewer than `min_samples` in either group waits. Each judges from the evidence the
deployment gives (`EVIDENCE`): a sample carries None where its shape showed nothing for a gate (no
first token behind a gateway that shows the picker response headers only, no ITL for a response that
is not streamed). A gate that no sample of a full window could feed is `unobservable`: it says so
and does not hold the rollout. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from picker.config.model import RolloutConfig
from picker.streams import EndReason

CUT = frozenset({EndReason.UPSTREAM_TRUNCATED, EndReason.UPSTREAM_ERROR_EVENT, EndReason.STALLED})


class Sample(NamedTuple):
    """What one ended request says about its group (a tuple: one is made per request). None: the
    deployment showed nothing of it for this request."""

    at: float
    cut: bool | None  # ended after its first token without completing (None: its end unseen)
    error: bool | None  # 5xx before its first byte (None: no status seen)
    ttft_s: float | None
    itl_s: float | None


# What each gate reads, and what shows it: said by `/admin/rollout` and the start-up log line.
EVIDENCE: dict[str, str] = {
    "cut-rate": "each stream's end: the observer filter, the routing stream's body, the proxy, or "
    "Envoy's gRPC access log (its response flags)",
    "5xx-before-first-byte": "the response status: response headers, or the access log",
    "ttft-p95": "the first token: the observer filter, the routing stream's body, or the proxy",
    "itl-p95": "the gaps between chunks of streamed responses: the same as ttft-p95",
}
UNOBSERVABLE = "unobservable"
HINT = "not observable here: add the observer filter or the access log"


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
    samples: tuple[int, int]  # (candidate, stable) carrying this gate's evidence
    verdict: str  # pass, fail, wait, or unobservable (no sample could feed it: it holds nothing)

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
            "judges_from": EVIDENCE.get(self.gate, ""),
            **({"note": HINT} if self.verdict == UNOBSERVABLE else {}),
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
    gate: str,
    cand: Sequence[bool | None],
    stab: Sequence[bool | None],
    ratio: float,
    floor: float,
    least: int,
) -> Reading:
    c_seen, s_seen = [v for v in cand if v is not None], [v for v in stab if v is not None]
    counts = (len(c_seen), len(s_seen))
    if min(counts) < least:
        return Reading(gate, None, None, None, counts, _waiting(counts, len(cand), least))
    c, s = sum(c_seen) / len(c_seen), sum(s_seen) / len(s_seen)
    limit = max(s * ratio, floor)
    return Reading(gate, c, s, limit, counts, "fail" if c > limit else "pass")


def _latency(
    gate: str,
    cand: Sequence[float | None],
    stab: Sequence[float | None],
    ratio: float,
    floor_s: float,
    least: int,
) -> Reading:
    c_seen, s_seen = [v for v in cand if v is not None], [v for v in stab if v is not None]
    counts = (len(c_seen), len(s_seen))
    c, s = p95(c_seen), p95(s_seen)
    if min(counts) < least or c is None or s is None:
        return Reading(gate, c, s, None, counts, _waiting(counts, len(cand), least))
    limit = max(s * ratio, s + floor_s)
    return Reading(gate, c, s, limit, counts, "fail" if c > limit else "pass")


def _waiting(counts: tuple[int, int], candidate_samples: int, least: int) -> str:
    """Too few samples: `wait`, unless the candidate has a full count of samples and none of either
    group carried this gate's evidence (the shape cannot show it)."""
    return UNOBSERVABLE if candidate_samples >= least and counts == (0, 0) else "wait"


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
            [s.ttft_s for s in candidate],
            [s.ttft_s for s in stable],
            limits.ttft_ratio,
            limits.latency_floor_s,
            least,
        ),
        _latency(
            "itl-p95",
            [s.itl_s for s in candidate],
            [s.itl_s for s in stable],
            limits.itl_ratio,
            limits.latency_floor_s,
            least,
        ),
    ]


def step_may_end(readings: Sequence[Reading]) -> bool:
    """Every gate that can judge passes (one at least): the unobservable ones hold nothing."""
    verdicts = {r.verdict for r in readings}
    return "pass" in verdicts and verdicts <= {"pass", UNOBSERVABLE}
