"""Drain records: how one endpoint's drain went, from the moment the picker learned of it to its exit.

A record opens when an endpoint enters DRAINING (or disappears while requests are still in flight on
it) and closes when the endpoint leaves that condition: back to READY / NOT_READY, or GONE once its
last request has ended. It is the drain scorecard: requests in flight at the start, how each request
attributed to the endpoint ended, picks after the start (must stay 0) and the time to zero in flight.

Plain data in the pool's own vocabulary; the pool mutates records, everyone else reads `summary()`.
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field


class DrainEnd(enum.Enum):
    """How one request attributed to an endpoint ended, in the pool's words (closed set).

    The request path maps its own end reasons onto these (picker/request/pipeline.py `finish`)."""

    COMPLETED = "completed"  # the response reached its end
    CLIENT_DISCONNECT = "client-disconnect"  # the client went away first
    UPSTREAM_ERROR = "upstream-error"  # the model server answered with an error (e.g. a 5xx)
    CUT = "cut"  # the stream ended before its response did, without the client leaving
    UNKNOWN = "unknown"  # the picker never saw how it ended
    # a prefill hand-off (picker/pool/lease.py PullLease): the decode replica pulled its KV, or the
    # drain's bound for pulls ran out first (the decode side recomputes what it could not pull)
    PULLED = "kv-pulled"
    PULL_ABANDONED = "kv-pull-abandoned"


_PULL_ENDS = frozenset({DrainEnd.PULLED, DrainEnd.PULL_ABANDONED})


class DrainCause(enum.Enum):
    """Why a record opened (closed set)."""

    SOURCE = "source"  # the endpoint source says draining (an EndpointSlice's terminating endpoint)
    ADMIN = "admin"  # POST /admin/endpoints/<addr>/drain, or the endpoints file's `draining: true` (admin's)
    REMOVED = "removed"  # removed from the source while requests were in flight, without a drain first


class DrainExit(enum.Enum):
    """How a record closed: the state the endpoint left DRAINING for (closed set)."""

    GONE = "gone"  # removed from the source, and its last in-flight request ended
    READY = "ready"  # ready again (slice ready, file entry no longer draining, admin undrain)
    NOT_READY = "not-ready"  # listed, not draining, but not ready either (failing probes)


@dataclass(slots=True)
class DrainRecord:
    """One drain of one endpoint. Times on `started_at`/`zero_at`/`closed_at` are the pool's clock."""

    address: str
    cause: DrainCause
    source: str
    started_at: float
    started_wall: float  # wall clock (seconds since the epoch), to line up with other logs
    in_flight_at_start: int
    pulls_at_start: int = 0  # of those, prefill hand-offs whose KV a decode replica had still to pull
    # answers that failed on the endpoint (before their first byte) in the seconds before the record
    # opened: a replica that stopped taking work before the picker learned of its drain (vLLM's 500)
    failed_before_start: int = 0
    ends: Counter[DrainEnd] = field(default_factory=Counter)
    picks_after_start: int = 0
    moved_away: int = 0  # in flight at the start, but served by another endpoint (Envoy fallback)
    # served here by Envoy's fallback walk over a list handed out before the drain began
    moved_in: int = 0
    zero_at: float | None = None  # when in flight last reached 0
    closed_at: float | None = None
    exit: DrainExit | None = None

    def __post_init__(self) -> None:
        if self.in_flight_at_start == 0:
            self.zero_at = self.started_at

    @property
    def open(self) -> bool:
        return self.closed_at is None

    @property
    def time_to_zero_s(self) -> float | None:
        return None if self.zero_at is None else self.zero_at - self.started_at

    def duration_s(self, now: float) -> float:
        return (self.closed_at if self.closed_at is not None else now) - self.started_at

    def request_ended(self, end: DrainEnd, in_flight_now: int, now: float) -> None:
        self.ends[end] += 1
        self._left(in_flight_now, now)

    def request_moved_away(self, in_flight_now: int, now: float) -> None:
        self.moved_away += 1
        self._left(in_flight_now, now)

    def moved_in_request(self) -> None:
        """A fallback of a list handed out before the drain began was served here: not a late pick."""
        self.moved_in += 1
        self.zero_at = None

    def picked(self) -> None:
        """New work reached the endpoint after the drain started: the count that must stay 0."""
        self.picks_after_start += 1
        self.zero_at = None

    def close(self, exit_state: DrainExit, now: float) -> None:
        self.exit = exit_state
        self.closed_at = now

    def _left(self, in_flight_now: int, now: float) -> None:
        if in_flight_now == 0:
            self.zero_at = now

    def summary(self, now: float) -> dict[str, object]:
        """Plain values for JSON, logs and the demo (durations in seconds, rounded to the ms)."""
        return {
            "address": self.address,
            "cause": self.cause.value,
            "source": self.source,
            "started_wall": round(self.started_wall, 3),
            "open": self.open,
            "duration_s": round(self.duration_s(now), 3),
            "in_flight_at_start": self.in_flight_at_start,
            "pulls_at_start": self.pulls_at_start,
            "failed_before_start": self.failed_before_start,
            "ended": {end.value: self.ends[end] for end in DrainEnd},
            "moved_away": self.moved_away,
            "moved_in": self.moved_in,
            "picks_after_start": self.picks_after_start,
            "time_to_zero_s": None if self.time_to_zero_s is None else round(self.time_to_zero_s, 3),
            "exit": None if self.exit is None else self.exit.value,
        }

    def log_line(self, now: float) -> str:
        """The one line logged when the record closes (key=value, no request content)."""
        # a pool without prefill / decode pairs never has a hand-off: its lines say nothing of them
        ends = " ".join(
            f"{end.value.replace('-', '_')}={self.ends[end]}"
            for end in DrainEnd
            if self.ends[end] or end not in _PULL_ENDS
        )
        pulls = f"pulls_at_start={self.pulls_at_start} " if self.pulls_at_start else ""
        to_zero = "none" if self.time_to_zero_s is None else f"{self.time_to_zero_s:.3f}"
        exit_value = self.exit.value if self.exit is not None else "open"
        return (
            f"drain closed address={self.address} cause={self.cause.value} source={self.source} "
            f"exit={exit_value} duration_s={self.duration_s(now):.3f} "
            f"in_flight_at_start={self.in_flight_at_start} {pulls}"
            f"failed_before_start={self.failed_before_start} {ends} moved_away={self.moved_away} "
            f"moved_in={self.moved_in} "
            f"picks_after_start={self.picks_after_start} time_to_zero_s={to_zero}"
        )


@dataclass(slots=True)
class DrainTotals:
    """Running totals over every drain since start (exported as counters at scrape time)."""

    opened: int = 0
    closed: Counter[DrainExit] = field(default_factory=Counter)
    ends: Counter[DrainEnd] = field(default_factory=Counter)
    picks_after_start: int = 0
    picks_not_ready: int = 0  # leases or served moves onto any endpoint that was not READY


_SAME_DRAIN_S = 10.0  # two pickers' records of one endpoint starting this close are one drain


def merge_summaries(per_picker: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """Several pickers' drain records (`DrainRecord.summary`) as the pool's: records of the same
    endpoint whose starts lie within seconds of each other are one drain, their counts summed (each
    picker counted its own requests), open while any is, as long as the longest. Newest first."""
    merged: list[dict[str, object]] = []
    for summary in sorted(
        (s for records in per_picker for s in records),
        key=lambda s: float(s["started_wall"]),  # type: ignore[arg-type]
    ):
        same = next(
            (
                m
                for m in merged
                if m["address"] == summary["address"]
                and float(summary["started_wall"]) - float(m["started_wall"]) <= _SAME_DRAIN_S  # type: ignore[arg-type]
            ),
            None,
        )
        if same is None:
            merged.append({**summary, "ended": dict(summary["ended"]), "pickers": 1})  # type: ignore[arg-type]
            continue
        for key in (
            "in_flight_at_start",
            "pulls_at_start",
            "failed_before_start",
            "moved_away",
            "moved_in",
            "picks_after_start",
        ):
            same[key] = int(same.get(key, 0)) + int(summary.get(key, 0))  # type: ignore[call-overload]
        ends = same["ended"]
        assert isinstance(ends, dict)
        for end, count in dict(summary["ended"]).items():  # type: ignore[call-overload]
            ends[end] = int(ends.get(end, 0)) + int(count)
        same["open"] = bool(same["open"]) or bool(summary["open"])
        same["duration_s"] = max(float(same["duration_s"]), float(summary["duration_s"]))  # type: ignore[arg-type]
        zero = [z for z in (same["time_to_zero_s"], summary["time_to_zero_s"]) if z is not None]
        same["time_to_zero_s"] = None if same["open"] and len(zero) < 2 else max(zero, default=None)  # type: ignore[type-var]
        same["exit"] = same["exit"] or summary["exit"]
        same["pickers"] = int(same["pickers"]) + 1  # type: ignore[call-overload]
    return sorted(merged, key=lambda s: float(s["started_wall"]), reverse=True)  # type: ignore[arg-type]
