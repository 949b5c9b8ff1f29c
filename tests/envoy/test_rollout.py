"""The rollout benchmark end to end, small: both setups through the real Envoy, the same arrivals.

Keeps `make rollout` working as the stack evolves, and holds the picker's side to its claim: a rolling
update behind the picker loses no request and sends nothing to a draining replica.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.rollout.load import poisson_arrivals
from loadtest.rollout.report import clients_table, drains_table
from loadtest.rollout.rolling import RolloutOptions, panels, run_setup
from loadtest.rollout.timeline import draw

pytestmark = pytest.mark.envoy

OPTIONS = RolloutOptions(replicas=2, rate=12.0, duration_s=6.0, tokens=(10, 40), rollout_at_s=1.0)


async def test_a_small_rollout_with_and_without_the_picker(tmp_path: Path) -> None:
    arrivals = poisson_arrivals(OPTIONS.rate, OPTIONS.duration_s, OPTIONS.tokens, OPTIONS.seed)
    naive = await run_setup("round-robin", OPTIONS, arrivals, tmp_path / "a")
    picked = await run_setup("picker", OPTIONS, arrivals, tmp_path / "b")

    for run in (naive, picked):
        assert len(run.load.outcomes) == len(arrivals)
        states = {(e.replica, e.state) for e in run.events if e.kind == "state"}
        old = [a for a, name in run.lane_names.items() if name.startswith("old")]
        new = [a for a, name in run.lane_names.items() if name.startswith("new")]
        assert len(old) == len(new) == OPTIONS.replicas
        assert all((a, "gone") in states for a in old) and all((a, "ready") in states for a in new)
    assert picked.load.kinds() == {"completed": len(arrivals)}, picked.load.kinds()
    assert picked.drains is not None and len(picked.drains) == OPTIONS.replicas
    for row in picked.drains:
        assert row["picks_after_start"] == 0 and row["forced_cuts"] == 0 and row["exit"] == "gone"
        assert row["completed"] == row["in_flight_at_start"]
    assert "completed" in clients_table([naive, picked]) and "picks_after" in drains_table(picked)
    png = draw(panels([naive, picked], ["a", "b"]), tmp_path / "timeline.png", "test")
    assert png.stat().st_size > 10_000
