"""The scale-down benchmark's figures, side by side: what each deletion cut and how long its drain took,
what the clients saw, and how many annotation writes the picker made."""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.rollout.load import Outcome
from loadtest.rollout.report import side_by_side
from loadtest.scale_down.cluster import Deletion
from loadtest.scale_down.run import TIME_SCALE, ArmRun


@dataclass(frozen=True)
class DrainFigures:
    deletion: Deletion
    in_flight: int  # streams on the replica when its pod was deleted
    cut: int  # of them, those that did not complete
    drain_s: float  # from the deletion to its last stream's end (0: it had none)


def _end_s(outcome: Outcome) -> float:
    return outcome.sent_s + outcome.result.t_end


def drains(run: ArmRun) -> list[DrainFigures]:
    out = []
    for deletion in run.deletions:
        there = [
            o
            for o in run.load.outcomes
            if o.replica == deletion.address and o.sent_s <= deletion.at_s < _end_s(o)
        ]
        cut = sum(1 for o in there if o.kind != "completed")
        drain = max((_end_s(o) - deletion.at_s for o in there), default=0.0)
        out.append(DrainFigures(deletion, len(there), cut, drain))
    return out


def would_lose(run: ArmRun, at: float, address: str, grace_s: float) -> tuple[int, float]:
    """What deleting the replica at `at` loses, read from how its streams really ended: the streams
    that ran (or would have run) past the grace period, and its drain (capped at the grace period)."""
    there = [o for o in run.load.outcomes if o.replica == address and o.sent_s <= at < _end_s(o)]
    past = sum(1 for o in there if o.kind != "completed" or _end_s(o) - at > grace_s)
    return past, min(grace_s, max((_end_s(o) - at for o in there), default=0.0))


def moments(run: ArmRun) -> list[list[Deletion]]:
    """The deletions grouped by scale-down (those of one decision are made within a moment)."""
    groups: list[list[Deletion]] = []
    for deletion in sorted(run.deletions, key=lambda d: d.at_s):
        if groups and deletion.ranked == groups[-1][0].ranked:
            groups[-1].append(deletion)
        else:
            groups.append([deletion])
    return groups


def best_drains(run: ArmRun, grace_s: float) -> list[float]:
    """The drains a perfect choice would have had: at each scale-down, the pods with the fewest
    streams still running at the grace period, then the shortest drain, read from how every pod's
    streams really ended (a stream cut at the grace period counts as running past it)."""
    out: list[float] = []
    for chosen in moments(run):
        at = chosen[0].at_s
        candidates = sorted(would_lose(run, at, a, grace_s) for a in chosen[0].addresses.values())
        out += [drain for _, drain in candidates[: len(chosen)]]
    return out


def writes_per_window(run: ArmRun, window_s: float) -> tuple[int, float | None]:
    """The most annotation writes of one pod within any `window_s`, and the shortest gap between two
    writes of one pod (None: no pod was written twice)."""
    times: dict[str, list[float]] = defaultdict(list)
    for patch in run.patches:
        if patch["status"] == 200:
            times[patch["name"]].append(patch["at"])
    most, gap = 0, None
    for stamps in times.values():
        stamps.sort()
        for i, start in enumerate(stamps):
            most = max(most, sum(1 for t in stamps[i:] if t < start + window_s))
        for a, b in itertools.pairwise(stamps):
            gap = b - a if gap is None else min(gap, b - a)
    return most, gap


def _p50(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.0


def rows(run: ArmRun, interval_s: float, grace_s: float) -> dict[str, str]:
    figures = drains(run)
    best = _p50(best_drains(run, grace_s))
    kinds = run.load.kinds()
    written = sum(1 for p in run.patches if p["status"] == 200)
    pods = len({p["name"] for p in run.patches if p["status"] == 200})
    most, gap = writes_per_window(run, interval_s)
    p50 = _p50([f.drain_s for f in figures])
    return {
        "deleted": str(len(figures)),
        "in_flight": str(sum(f.in_flight for f in figures)),
        "cut": str(sum(f.cut for f in figures)),
        "drain_p50": f"{p50:.2f} s ({p50 * TIME_SCALE:.0f} s)",
        "drain_best": f"{best:.2f} s ({best * TIME_SCALE:.0f} s)",
        "drain_max": f"{max((f.drain_s for f in figures), default=0.0):.2f} s",
        "sent": str(len(run.load.outcomes)),
        "failed": str(len(run.load.outcomes) - kinds.get("completed", 0)),
        "failed_kinds": ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()) if k != "completed") or "-",
        "writes": f"{written} on {pods} pods" if written else "0",
        "writes_window": f"{most}" + (f" (shortest gap {gap:.2f} s)" if gap is not None else ""),
        "quiet_writes": str(run.quiet_writes),
    }


LABELS = (
    ("deleted", "pods the ReplicaSet controller deleted"),
    ("in_flight", "streams on them when deleted"),
    ("cut", "of those, cut at the grace period (not completed)"),
    ("drain_p50", "drain time, deletion to last stream's end, p50 (issue's scale)"),
    ("drain_best", "drain time p50 had the victims been the best choice (same run)"),
    ("drain_max", "drain time, longest"),
    ("sent", "requests sent (the same seeded arrivals in both runs)"),
    ("failed", "requests that did not complete, in all"),
    ("failed_kinds", "how they ended"),
    ("writes", "pod-deletion-cost annotation writes (PATCH)"),
    ("writes_window", "most writes of one pod within one interval"),
    ("quiet_writes", "writes in 3 intervals with nothing changing"),
)


def table(runs: Sequence[ArmRun], interval_s: float, grace_s: float) -> str:
    columns = [rows(run, interval_s, grace_s) for run in runs]
    return side_by_side([run.title for run in runs], columns, LABELS, 16)


def deletions_detail(run: ArmRun, grace_s: float) -> str:
    lines = []
    figures = {id(f.deletion): f for f in drains(run)}
    for chosen in moments(run):
        at = chosen[0].at_s
        lost = {name: would_lose(run, at, address, grace_s) for name, address in chosen[0].addresses.items()}
        pods = ", ".join(f"{name} {lost[name][1]:.1f} s" + ("*" * lost[name][0]) for name in chosen[0].ranked)
        lines.append(
            f"  t={at:5.1f} s  the controller's order, each pod's drain had it gone (* a cut): {pods}"
        )
        for d in chosen:
            f = figures[id(d)]
            lines.append(
                f"      deleted {d.pod:<11} cost={d.cost or '-':>6}  streams {f.in_flight}  cut {f.cut}  "
                f"drain {f.drain_s:.2f} s"
            )
    return "\n".join(lines)


def goals(default: ArmRun, ranked: ArmRun, interval_s: float) -> str:
    """The issue's goals, read from the two runs."""
    mine, theirs = drains(ranked), drains(default)
    cut = sum(f.cut for f in mine)
    p50, before = _p50([f.drain_s for f in mine]), _p50([f.drain_s for f in theirs])
    most, _ = writes_per_window(ranked, interval_s)
    ratio = f"{p50 / before:.2f} of the default's" if before else "n/a (no drain in the default run)"
    return "\n".join(
        [
            f"  streams cut with the picker's cost: {cut} (goal 0): {'met' if cut == 0 else 'NOT met'}",
            f"  drain time p50: {p50:.2f} s against {before:.2f} s, {ratio} (goal: at most half): "
            + ("met" if before and p50 <= before / 2 else "NOT met"),
            f"  writes of one pod within one interval, at most: {most} (goal 1): "
            + ("met" if most <= 1 else "NOT met"),
            f"  writes while nothing changed: {ranked.quiet_writes} (goal 0): "
            + ("met" if ranked.quiet_writes == 0 else "NOT met"),
        ]
    )
