"""The scale-down benchmark's pure parts: the ReplicaSet controller's deletion order, the mixed seeded
arrivals, and the figures read from what the clients saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.rollout.load import LoadReport, Outcome
from loadtest.scale_down.cluster import Deletion, stamp
from loadtest.scale_down.picture import panel, picture
from loadtest.scale_down.replicaset import DELETION_COST, victims
from loadtest.scale_down.report import best_drains, drains, writes_per_window
from loadtest.scale_down.run import ArmRun, Options, mixed_arrivals
from loadtest.sse_client import SseEvent, StreamResult

NOW = 2_000_000_000.0


def pod(
    name: str, age_s: float, *, cost: str | None = None, ready: bool = True, **meta: Any
) -> dict[str, Any]:
    metadata: dict[str, Any] = {
        "name": name,
        "uid": f"uid-{name}",
        "creationTimestamp": stamp(NOW - age_s),
        **meta,
    }
    if cost is not None:
        metadata["annotations"] = {DELETION_COST: cost}
    condition = {
        "type": "Ready",
        "status": "True" if ready else "False",
        "lastTransitionTime": stamp(NOW - age_s),
    }
    return {
        "metadata": metadata,
        "spec": {"nodeName": "n"},
        "status": {"phase": "Running", "conditions": [condition]},
    }


def names(chosen: list[Any]) -> list[str]:
    return [p["metadata"]["name"] for p in chosen]


def test_without_a_cost_the_controller_deletes_the_youngest_ready_pods_first() -> None:
    pods = [pod("old", 3600), pod("mid", 900), pod("young", 60), pod("new", 20)]
    assert names(victims(pods, 2, NOW)) == ["new", "young"]


def test_not_ready_pods_go_before_any_cost_and_the_cost_before_age() -> None:
    pods = [
        pod("old", 3600, cost="0"),
        pod("new", 20, cost="9000"),
        pod("starting", 5, ready=False, cost="99"),
    ]
    assert names(victims(pods, 3, NOW)) == ["starting", "old", "new"]
    assert names(victims([pod("a", 60, cost="-5"), pod("b", 60)], 1, NOW)) == ["a"]  # none: 0
    assert names(victims([pod("a", 3600, cost="x"), pod("b", 20, cost="1")], 1, NOW)) == ["a"]  # invalid: 0


def test_the_same_log_scale_age_falls_to_the_uid_and_deleted_pods_are_not_counted() -> None:
    pods = [pod("b", 100), pod("a", 110), pod("gone", 1, deletionTimestamp=stamp(NOW))]
    assert names(victims(pods, 2, NOW)) == ["a", "b"]  # 100 s and 110 s: one log2 rank of nanoseconds


def test_arrivals_are_seeded_and_mixed() -> None:
    options = Options(rate=10.0, long_share=0.3)
    arrivals = mixed_arrivals(options)
    assert arrivals == mixed_arrivals(options)
    long = [a for a in arrivals if a.max_tokens >= options.long_tokens[0]]
    assert 0.2 < len(long) / len(arrivals) < 0.4
    assert all(options.short_tokens[0] <= a.max_tokens <= options.long_tokens[1] for a in arrivals)
    assert arrivals[-1].at_s < options.duration_s


def outcome(sent: float, end: float, replica: str, finish: str = "length") -> Outcome:
    result = StreamResult(status=200, headers={"x-sim-replica": replica}, t_headers=0.01, t_end=end - sent)
    result.events = [
        SseEvent(json.dumps({"choices": [{"text": "x", "finish_reason": finish}]}), 0.1),
        SseEvent("[DONE]", 0.2),
    ]
    return Outcome(sent, result)


def test_drain_figures_count_the_streams_on_the_victim_at_its_deletion() -> None:
    load = LoadReport(
        [
            outcome(1.0, 12.0, "127.0.0.1:1"),  # in flight at 10: ends 2 s into the drain
            outcome(5.0, 16.0, "127.0.0.1:1", finish="abort"),  # cut at the grace period
            outcome(2.0, 9.0, "127.0.0.1:1"),  # over before the deletion
            outcome(3.0, 30.0, "127.0.0.1:2"),  # another replica
        ]
    )
    run = ArmRun(
        "t",
        True,
        load,
        [Deletion("p1", "127.0.0.1:1", 10.0, "0"), Deletion("p3", "127.0.0.1:3", 10.0, None)],
        [],
        0,
    )
    first, idle = drains(run)
    assert (first.in_flight, first.cut, first.drain_s) == (2, 1, 6.0)
    assert (idle.in_flight, idle.cut, idle.drain_s) == (0, 0, 0.0)


def test_writes_per_window_and_the_shortest_gap() -> None:
    patches = [
        {"name": n, "at": at, "status": 200} for n, at in (("a", 0.0), ("a", 1.5), ("a", 2.0), ("b", 0.2))
    ]
    run = ArmRun("t", True, LoadReport(), [], [*patches, {"name": "a", "at": 2.1, "status": 409}], 0)
    assert writes_per_window(run, 1.0) == (2, 0.5)


def test_the_best_choice_is_read_from_how_every_pods_streams_really_ended() -> None:
    load = LoadReport(
        [
            outcome(1.0, 18.0, "127.0.0.1:1", finish="abort"),  # the victim's: cut at the grace period
            outcome(9.0, 13.0, "127.0.0.1:2"),  # ends 3 s after the scale-down
            outcome(9.0, 11.0, "127.0.0.1:3"),  # 1 s after
            outcome(8.0, 30.0, "127.0.0.1:4"),  # would have run past the grace period
        ]
    )
    everyone = {f"p{i}": f"127.0.0.1:{i}" for i in range(1, 5)}
    ranked = list(everyone)
    deletions = [
        Deletion("p1", "127.0.0.1:1", 10.0, "0", ranked, everyone),
        Deletion("p4", "127.0.0.1:4", 10.05, "1", ranked, everyone),  # one decision, a moment later
    ]
    run = ArmRun("t", True, load, deletions, [], 0)
    assert best_drains(run, grace_s=6.0) == [1.0, 3.0]  # p3 and p2: nothing cut


def test_the_picture_draws_each_victims_lane_ready_draining_and_gone(tmp_path: Path) -> None:
    options = Options(warmup_s=15.0, grace_s=6.0, settle_s=12.0)
    initial = {f"p{n}": f"127.0.0.1:{n}" for n in range(1, 5)}
    later = {"p1": "127.0.0.1:1", "p2": "127.0.0.1:2", "p5": "127.0.0.1:5", "p6": "127.0.0.1:6"}
    cut = outcome(14.5, 40.0, "127.0.0.1:4", finish="abort")
    load = LoadReport([outcome(14.0, 17.0, "127.0.0.1:3"), cut])
    deletions = [
        Deletion("p3", "127.0.0.1:3", 15.0, "0", addresses=initial),
        Deletion("p4", "127.0.0.1:4", 15.0, "0", addresses=initial),
        Deletion("p5", "127.0.0.1:5", 15.0 + options.cycle_s, "0", addresses=later),
    ]
    drawn = panel(ArmRun("the picker's pod-deletion-cost", True, load, deletions, [], 0), options, "(b)")
    states = sorted((e.replica, e.t, e.state) for e in drawn.events if e.kind == "state")
    assert ("127.0.0.1:3", 15.0, "draining") in states and ("127.0.0.1:3", 17.0, "gone") in states
    assert ("127.0.0.1:4", 21.0, "gone") in states  # cut at the grace period
    born = 15.0 + options.grace_s + 1.0  # the scale-up after the first scale-down
    assert ("127.0.0.1:5", born, "ready") in states and ("127.0.0.1:1", 0.0, "ready") in states
    marks = sorted((e.replica, e.label) for e in drawn.events if e.kind == "mark")
    assert ("127.0.0.1:4", "SIGKILL") in marks and ("127.0.0.1:3", "SIGKILL") not in marks
    assert "1 streams cut" in drawn.note
    default = ArmRun("default", False, load, deletions, [], 0)
    path = picture([default, default], options, tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
