"""The rollout picture: one lane per replica, drawn from a flat list of timeline events.

Kept apart from the rollout driver so anything that watched a drain (`picker demo`, a test) can draw the
same picture: build `TimelineEvent`s (or use `stream_event` / `state_event` / `error_event`), group
them into one `Panel` per setup, and call `draw(panels, path)`. Panels share one time axis, so two
setups that replayed the same arrivals line up one above the other.

Per panel: lanes of replicas with their state as a coloured band (starting / ready / draining / gone),
the number of streams in flight on each as a line inside its lane, what clients saw go wrong as
markers (on the replica that answered, or on a lane of its own when no replica did), and beneath, the
p99 time to first token per second.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATES = ("starting", "ready", "draining", "gone")
_STATE_COLOURS = {"starting": "#cfe3f7", "ready": "#d5efd0", "draining": "#fde3b5", "gone": "#e4e4e4"}
_STATE_HELP = {
    "starting": "starting (not in the pool yet)",
    "ready": "ready (gets new requests)",
    "draining": "draining (finishing its streams, told to stop)",
    "gone": "gone (process exited)",
}
# What a client saw, in the order the legend lists them; the marker says how bad.
ERROR_STYLES = {
    "HTTP 500": ("X", "#d62728"),
    "HTTP 502": ("X", "#8c1010"),
    "HTTP 503": ("X", "#ff4f9a"),
    "HTTP 5xx": ("X", "#b30059"),
    "contract 503": ("P", "#7f7f7f"),
    "429": ("P", "#bcbd22"),
    "truncated": ("v", "#9467bd"),
    "abort": ("D", "#e377c2"),
    "hung": ("s", "#000000"),
    "conn error": ("*", "#8c564b"),
}
# Moments in a replica's termination, drawn as vertical ticks across its lane.
MARK_STYLES = {
    "router told": ("--", "#c25400", "router told: endpoint removed / marked draining"),
    "SIGTERM": ("-", "#000000", "SIGTERM sent to the replica"),
    "weight step": (":", "#2a7a2a", "canary: the candidate's weight stepped up (or promoted)"),
    "rolled back": ("-", "#d62728", "canary: a gate failed, weight 0, candidate drained"),
    "SIGKILL": ("-", "#7b2cbf", "SIGKILL: the replica crashed (its streams cut mid-sentence)"),
}
NO_REPLICA = "(no replica)"
_SAMPLE_S = 0.1


@dataclass(frozen=True)
class TimelineEvent:
    """One fact on the time axis, in seconds since the run started.

    kind "state": `replica` entered `state` at `t`; kind "stream": a stream served by `replica` from
    `t` to `end` (its first token after `ttft` s); kind "error": a client saw `label` at `t` (`replica`
    is empty when no replica answered); kind "mark": a moment `label` (a MARK_STYLES key) on `replica`;
    kind "load": `replica` reported `value` requests in flight at `t` (a sample of its own /metrics)."""

    t: float
    kind: str
    replica: str = ""
    state: str = ""
    end: float | None = None
    ttft: float | None = None
    label: str = ""
    value: int = 0


def state_event(t: float, replica: str, state: str) -> TimelineEvent:
    if state not in STATES:
        raise ValueError(f"unknown state {state!r}; one of {STATES}")
    return TimelineEvent(t, "state", replica, state=state)


def stream_event(start: float, end: float, replica: str, ttft: float | None) -> TimelineEvent:
    return TimelineEvent(start, "stream", replica, end=end, ttft=ttft)


def error_event(t: float, label: str, replica: str = "") -> TimelineEvent:
    return TimelineEvent(t, "error", replica, label=label)


def mark_event(t: float, replica: str, label: str) -> TimelineEvent:
    if label not in MARK_STYLES:
        raise ValueError(f"unknown mark {label!r}; one of {list(MARK_STYLES)}")
    return TimelineEvent(t, "mark", replica, label=label)


def load_event(t: float, replica: str, value: int) -> TimelineEvent:
    """A sample of the requests `replica` itself reports in flight: its lane's line when it has any."""
    return TimelineEvent(t, "load", replica, value=value)


@dataclass
class Panel:
    """One setup's events under one title (e.g. "Envoy round robin + /health checks")."""

    title: str
    events: list[TimelineEvent] = field(default_factory=list)
    note: str = ""  # a one-line verdict printed under the title
    lane_names: dict[str, str] = field(default_factory=dict)  # replica -> what the lane says


def _lanes(panel: Panel) -> list[str]:
    """Replicas in the order they first appear; "(no replica)" last, only when some error had none."""
    order: dict[str, None] = {}
    for event in sorted(panel.events, key=lambda e: e.t):
        if event.replica:
            order.setdefault(event.replica, None)
    lanes = list(order)
    if any(e.kind == "error" and not e.replica for e in panel.events):
        lanes.append(NO_REPLICA)
    return lanes


def _bands(panel: Panel, replica: str, t_end: float) -> list[tuple[float, float, str]]:
    changes = sorted((e.t, e.state) for e in panel.events if e.kind == "state" and e.replica == replica)
    return [
        (t, changes[i + 1][0] if i + 1 < len(changes) else t_end, state)
        for i, (t, state) in enumerate(changes)
    ]


def in_flight_series(
    events: Sequence[TimelineEvent], replica: str, t_end: float
) -> tuple[list[float], list[int]]:
    """Streams in flight on `replica`, sampled every 0.1 s from 0 to `t_end`.

    From the replica's own samples ("load" events, each held until the next) when it has any, else
    by counting the streams the clients saw it serve."""
    steps = int(t_end / _SAMPLE_S) + 1
    samples = sorted((e.t, e.value) for e in events if e.kind == "load" and e.replica == replica)
    if samples:
        held, index, current = [], 0, 0
        for i in range(steps):
            while index < len(samples) and samples[index][0] <= i * _SAMPLE_S:
                current = samples[index][1]
                index += 1
            held.append(current)
        return [i * _SAMPLE_S for i in range(steps)], held
    delta = [0] * (steps + 1)
    for e in events:
        if e.kind == "stream" and e.replica == replica and e.end is not None:
            delta[max(0, min(steps, math.floor(e.t / _SAMPLE_S)))] += 1
            delta[max(0, min(steps, math.ceil(e.end / _SAMPLE_S)))] -= 1
    times, values, running = [], [], 0
    for i in range(steps):
        running += delta[i]
        times.append(i * _SAMPLE_S)
        values.append(running)
    return times, values


def ttft_p99_per_second(events: Sequence[TimelineEvent]) -> tuple[list[float], list[float]]:
    """p99 (nearest rank) of the TTFTs of streams that started in each whole second."""
    by_second: dict[int, list[float]] = defaultdict(list)
    for e in events:
        if e.kind == "stream" and e.ttft is not None:
            by_second[int(e.t)].append(e.ttft)
    seconds = sorted(by_second)
    values = []
    for s in seconds:
        ordered = sorted(by_second[s])
        values.append(ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] * 1000)
    return [s + 0.5 for s in seconds], values


def _t_end(panels: Sequence[Panel]) -> float:
    ends = [e.end if e.end is not None else e.t for p in panels for e in p.events]
    return max(ends, default=1.0) + 0.5


def _draw_lanes(
    ax: Any, panel: Panel, lane_list: list[str], t_end: float, scale: float, seen: set[str]
) -> None:
    """State bands, the in-flight line, termination ticks and client errors of each replica's lane."""
    for row, replica in enumerate(lane_list):
        base = len(lane_list) - 1 - row
        for start, stop, state in _bands(panel, replica, t_end):
            ax.fill_between([start, stop], base + 0.02, base + 0.98, color=_STATE_COLOURS[state], lw=0)
        times, values = in_flight_series(panel.events, replica, t_end)
        if any(values):
            ax.step(times, [base + 0.08 + v * scale for v in values], where="post", color="#1f4e9c", lw=1.2)
            top = max(values)
            ax.text(times[values.index(top)], base + 0.1 + top * scale, f"{top}", fontsize=7, color="#1f4e9c")
        for event in panel.events:
            if event.kind == "mark" and event.replica == replica:
                style, colour, _ = MARK_STYLES[event.label]
                ax.plot([event.t, event.t], [base + 0.04, base + 0.96], ls=style, color=colour, lw=1.6)
                seen.add(event.label)
        errors = [e for e in panel.events if e.kind == "error" and (e.replica or NO_REPLICA) == replica]
        for label, (marker, colour) in ERROR_STYLES.items():
            mine = [e.t for e in errors if e.label == label]
            if mine:
                ax.scatter(mine, [base + 0.5] * len(mine), marker=marker, color=colour, s=36, zorder=5)
                seen.add(label)
    names = [panel.lane_names.get(r, r) for r in lane_list]
    ax.set_yticks([len(lane_list) - 1 - i + 0.5 for i in range(len(lane_list))], names, fontsize=8)
    ax.set_ylim(0, max(1, len(lane_list)))


def _legend(peak: int, seen: set[str], sampled: bool = False) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles: list[Any] = [
        Patch(facecolor=_STATE_COLOURS[s], edgecolor="#999999", label=_STATE_HELP[s]) for s in STATES
    ]
    line = "requests in the replica (its /metrics: running + waiting)" if sampled else "streams in flight"
    handles.append(Line2D([], [], color="#1f4e9c", label=f"{line} (full lane = {peak})"))
    for label, (style, colour, text) in MARK_STYLES.items():
        if label in seen:
            handles.append(Line2D([], [], ls=style, color=colour, lw=1.6, label=text))
    for label, (marker, colour) in ERROR_STYLES.items():
        if label in seen:
            handles.append(
                Line2D([], [], ls="", marker=marker, color=colour, markersize=7, label=f"client saw: {label}")
            )
    return handles


def draw(panels: Sequence[Panel], path: Path, title: str = "", caption: str = "") -> Path:
    """Write the picture of `panels` (stacked, one shared time axis) as a PNG at `path`; returns it.

    `caption`: a line or two under the title telling a newcomer how to read the picture."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_end = _t_end(panels)
    lanes = [_lanes(p) for p in panels]
    ratios: list[float] = []
    for lane_list in lanes:
        ratios += [max(2.0, 0.75 * len(lane_list)), 1.0]
    figure, axes = plt.subplots(
        len(ratios),
        1,
        sharex=True,
        figsize=(14, 2.6 + sum(ratios) * 0.95),
        gridspec_kw={"height_ratios": ratios, "hspace": 0.45},
    )
    series = [
        in_flight_series(p.events, r, t_end)[1] for p, ls in zip(panels, lanes, strict=True) for r in ls
    ]
    peak = max((max(v, default=0) for v in series), default=1) or 1
    seen: set[str] = set()
    ttft_top = 1.0
    for index, (panel, lane_list) in enumerate(zip(panels, lanes, strict=True)):
        ax, ttft_ax = axes[2 * index], axes[2 * index + 1]
        _draw_lanes(ax, panel, lane_list, t_end, 0.8 / peak, seen)
        ax.set_title(panel.title + (f"\n{panel.note}" if panel.note else ""), loc="left", fontsize=10)
        ax.set_ylabel("replicas", fontsize=8)
        xs, ys = ttft_p99_per_second(panel.events)
        ttft_ax.bar(xs, ys, width=0.8, color="#6b8fbf")
        ttft_top = max(ttft_top, *ys) if ys else ttft_top
        ttft_ax.set_ylabel("TTFT p99 (ms)\nper second", fontsize=8)
        ttft_ax.grid(axis="y", alpha=0.3)
    for index in range(len(panels)):
        axes[2 * index + 1].set_ylim(0, ttft_top * 1.15)  # the same scale in every setup
    axes[-1].set_xlabel("seconds since the load started (the same arrivals in every run)")
    axes[-1].set_xlim(0, t_end)
    sampled = any(e.kind == "load" for p in panels for e in p.events)
    figure.legend(handles=_legend(peak, seen, sampled), loc="lower center", ncol=4, fontsize=8, frameon=False)
    height = figure.get_figheight()
    if title:
        figure.suptitle(title, y=1 - 0.15 / height, va="top", fontsize=12, fontweight="bold")
    if caption:
        figure.text(0.5, 1 - 0.5 / height, caption, ha="center", va="top", fontsize=9, color="#333333")
    top = 1 - (0.75 + 0.16 * (caption.count("\n") + 1 if caption else 0)) / height
    figure.subplots_adjust(top=top - 0.45 / height, bottom=1.45 / height, left=0.13, right=0.98)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
