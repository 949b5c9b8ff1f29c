"""The scale-down picture: both arms on one time axis, a lane per replica (the rollout timeline's).

Each replica's lane: ready from its pod's start, draining from its deletion (SIGTERM), gone once
its last stream ended or the grace period cut it; its streams in flight as a line, what the clients
saw go wrong as markers. Drawn by loadtest/rollout/timeline.py, so it reads like the rollouts'.
"""

from __future__ import annotations

from pathlib import Path

from loadtest.rollout.timeline import Panel, draw, mark_event, state_event
from loadtest.scale_down.report import drains
from loadtest.scale_down.run import ArmRun, Options


def _born(options: Options, cycle: int) -> float:
    """When the scale-up after `cycle` brings its pods (the run's schedule, `_scale`)."""
    return options.warmup_s + cycle * options.cycle_s + options.grace_s + 1.0


def panel(run: ArmRun, options: Options, label: str) -> Panel:
    events = run.load.timeline_events()
    first = [d.addresses for d in sorted(run.deletions, key=lambda d: d.at_s)[:1]]
    initial = set(first[0].values()) if first else set()
    for replica in initial:
        events.append(state_event(0.0, replica, "ready"))
    seen = set(initial)
    for figures in sorted(drains(run), key=lambda f: f.deletion.at_s):
        deletion = figures.deletion
        for replica in deletion.addresses.values():  # a pod first listed here came with a scale-up
            if replica not in seen:
                seen.add(replica)
                cycle = max(0, int((deletion.at_s - options.warmup_s) // options.cycle_s) - 1)
                events.append(state_event(_born(options, cycle), replica, "ready"))
        events.append(state_event(deletion.at_s, deletion.address, "draining"))
        events.append(mark_event(deletion.at_s, deletion.address, "SIGTERM"))
        gone = deletion.at_s + min(options.grace_s, figures.drain_s)
        events.append(state_event(gone, deletion.address, "gone"))
        if figures.cut:
            events.append(mark_event(deletion.at_s + options.grace_s, deletion.address, "SIGKILL"))
    cut = sum(f.cut for f in drains(run))
    note = f"{len(run.deletions)} pods deleted, {cut} streams cut at the grace period"
    return Panel(f"{label} {run.title}", events, note)


def picture(runs: list[ArmRun], options: Options, path: Path) -> Path:
    """Both arms stacked, the same arrivals: where each scale-down's victims were, and what they held."""
    panels = [panel(run, options, f"({chr(ord('a') + i)})") for i, run in enumerate(runs)]
    title = f"Scale-downs {options.replicas} -> {options.scale_to} under streaming load"
    caption = (
        "Each lane a replica; a stream in flight on it is its line. SIGTERM: its pod deleted (the "
        "ReplicaSet controller's choice); its streams finish, or the grace period cuts them (SIGKILL)."
    )
    return draw(panels, path, title, caption)
