"""Deletion costs -> annotation values with hysteresis: a sticky order, values that change only where the
order did, each pod at most once per interval, a bounded number of writes per step
(picker/pool/deletion_rank.py)."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from picker.pool.deletion_cost import PodRef
from picker.pool.deletion_rank import SPACING, Ranker, RankPolicy, assign, next_to_go, sticky_order

POLICY = RankPolicy(interval_s=10.0, margin_s=1.0, margin_ratio=0.25, max_writes=10)


def pods(*names: str, values: dict[str, int] | None = None) -> list[PodRef]:
    values = values or {}
    return [PodRef("ns", n, (f"{n}:8000",), value=values.get(n)) for n in names]


def costs(**by_name: float) -> dict[str, float]:
    return {f"ns/{name}": cost for name, cost in by_name.items()}


def applied(ranker: Ranker, plan_writes: list, now: float) -> dict[str, int]:  # type: ignore[type-arg]
    for write in plan_writes:
        ranker.wrote(write.pod, write.value, now)
    return {w.pod.name: w.value for w in plan_writes}


def test_a_fresh_pool_is_numbered_cheapest_first() -> None:
    ranker = Ranker(POLICY)
    plan = ranker.plan(pods("a", "b", "c"), costs(a=30, b=0, c=12), now=0.0)
    assert plan.order == ["ns/b", "ns/c", "ns/a"]
    assert {w.pod.name: w.value for w in plan.writes} == {"b": 0, "c": SPACING, "a": 2 * SPACING}


def test_no_write_while_the_ranks_hold_even_when_the_figures_wiggle() -> None:
    ranker = Ranker(POLICY)
    listed = pods("a", "b", "c")
    applied(ranker, ranker.plan(listed, costs(a=30, b=0, c=12), 0.0).writes, 0.0)
    for step, (a, b, c) in enumerate([(31, 0.4, 12.5), (28, 0.9, 11), (33, 0.0, 13.9), (30, 0.5, 12)], 1):
        plan = ranker.plan(listed, costs(a=a, b=b, c=c), now=100.0 * step)
        assert plan.writes == [] and plan.deferred == 0, (a, b, c)


def test_a_near_tie_keeps_its_order_and_a_clear_difference_reorders() -> None:
    current = {"x": 0, "y": 1000}
    assert sticky_order(["x", "y"], {"x": 10.0, "y": 9.0}, current, 1.0, 0.25) == ["x", "y"]  # 1 s: a wiggle
    assert sticky_order(["x", "y"], {"x": 10.0, "y": 2.0}, current, 1.0, 0.25) == ["y", "x"]
    assert sticky_order(["x", "y"], {"x": 0.9, "y": 0.0}, current, 1.0, 0.25) == ["x", "y"]  # under margin_s


def test_a_moved_pod_alone_is_rewritten_between_its_new_neighbours() -> None:
    ranker = Ranker(POLICY)
    listed = pods("a", "b", "c", "d", values={"a": 0, "b": 1000, "c": 2000, "d": 3000})
    plan = ranker.plan(listed, costs(a=1, b=95, c=60, d=70), now=0.0)  # b is now dearer than c and d
    assert [(w.pod.name, w.value) for w in plan.writes] == [("b", 3000 + SPACING)]
    assert plan.order == ["ns/a", "ns/c", "ns/d", "ns/b"]


def test_a_new_pod_is_the_only_write_when_it_joins() -> None:
    ranker = Ranker(POLICY)
    listed = pods("a", "b", "c", values={"a": 0, "b": 1000, "c": 2000})
    plan = ranker.plan([*listed, *pods("new")], costs(a=5, b=40, c=80, new=20), now=0.0)
    assert [(w.pod.name, w.value) for w in plan.writes] == [("new", 500)]


def test_each_pod_changes_at_most_once_per_interval() -> None:
    ranker = Ranker(POLICY)
    listed = pods("a", "b")
    applied(ranker, ranker.plan(listed, costs(a=0, b=30), 0.0).writes, 0.0)
    plan = ranker.plan(listed, costs(a=30, b=0), now=4.0)  # the order flips within the interval
    assert plan.writes == [] and plan.deferred == 1
    plan = ranker.plan(listed, costs(a=30, b=0), now=10.0)
    assert len(plan.writes) == 1 and plan.deferred == 0
    (moved,) = applied(ranker, plan.writes, 10.0)
    assert ranker.plan(listed, costs(a=30, b=0), now=15.0).writes == []  # as written: nothing to do
    back = ranker.plan(listed, costs(a=0, b=30), now=15.0)  # flips back: only the other pod may move
    assert [w.pod.name for w in back.writes] in ([], [n for n in ("a", "b") if n != moved])
    assert back.deferred + len(back.writes) == 1


def test_writes_per_step_are_bounded_cheapest_end_first() -> None:
    ranker = Ranker(RankPolicy(interval_s=10.0, margin_s=1.0, margin_ratio=0.25, max_writes=2))
    plan = ranker.plan(pods("a", "b", "c", "d"), costs(a=40, b=30, c=20, d=10), now=0.0)
    assert [w.pod.name for w in plan.writes] == ["d", "c"]
    assert plan.over_bound == 2
    applied(ranker, plan.writes, 0.0)
    plan = ranker.plan(pods("a", "b", "c", "d"), costs(a=40, b=30, c=20, d=10), now=1.0)
    assert [w.pod.name for w in plan.writes] == ["b", "a"] and plan.over_bound == 0


def test_pods_being_deleted_and_gone_pods_are_left_alone() -> None:
    ranker = Ranker(POLICY)
    listed = pods("a", "b")
    applied(ranker, ranker.plan(listed, costs(a=1, b=50), 0.0).writes, 0.0)
    ranker.keep_only({"ns/a"})
    assert set(ranker.written) == {"ns/a"}
    assert ranker.plan(listed, costs(a=1), now=20.0).writes == []  # b has no cost: deleting


def test_no_room_between_neighbours_numbers_afresh() -> None:
    assert assign(["a", "x", "b"], {"a": 5, "b": 6}) == {"a": 0, "x": SPACING, "b": 2 * SPACING}


@given(
    st.lists(st.integers(-3000, 3000) | st.none(), min_size=1, max_size=8),
    st.permutations(list(range(8))),
    st.sets(st.integers(0, 7)),
)
def test_assigned_values_rise_strictly_along_the_order_and_kept_values_stay(
    values: list[int | None], order_of: list[int], locked: set[int]
) -> None:
    keys = [f"p{i}" for i in range(len(values))]
    current = {k: v for k, v in zip(keys, values, strict=True) if v is not None}
    order = [keys[i] for i in order_of if i < len(keys)]
    out = assign(order, current, {keys[i] for i in locked if i < len(keys)})
    assert set(out) == set(order)
    assert all(out[a] < out[b] for a, b in itertools.pairwise(order))
    assert all(-(2**31) <= v < 2**31 for v in out.values())
    already_rising = all(current.get(a, -1) < current.get(b, 0) for a, b in itertools.pairwise(order))
    if len(current) == len(order) and already_rising:
        assert out == current  # nothing to change: nothing changes


def test_next_to_go_orders_endpoints_as_the_controller_would_delete_their_pods() -> None:
    """Lowest annotation first (a pod without one counts as 0, as the controller reads it); a pod
    already being deleted is no longer a choice; every endpoint of a pod shares its place."""
    listed = [
        PodRef("ns", "a", ("10.0.0.1:8000", "10.0.0.1:8001"), value=3000),
        PodRef("ns", "b", ("10.0.0.2:8000",), value=-5),
        PodRef("ns", "c", ("10.0.0.3:8000",)),
        PodRef("ns", "d", ("10.0.0.4:8000",), value=1, deleting=True),
    ]
    order = next_to_go(listed, lambda pod: pod.value)
    assert order == {"10.0.0.2:8000": 0.0, "10.0.0.3:8000": 0.5, "10.0.0.1:8000": 1.0, "10.0.0.1:8001": 1.0}
    written = {"ns/b": 9000}  # the writer's own values are newer than the watch's
    order = next_to_go(listed, lambda pod: written.get(pod.key, pod.value))
    assert order["10.0.0.2:8000"] == 1.0 and order["10.0.0.3:8000"] == 0.0
    assert next_to_go([], lambda pod: pod.value) == {}


def test_next_to_go_ties_share_a_place_and_no_value_at_all_steers_nothing() -> None:
    """The controller breaks equal costs by node and age, not by name: equal values, one place; a
    pool with no value yet (a slice source before the first write) gives nothing to steer by."""
    listed = [
        PodRef("ns", n, (f"10.0.0.{i}:8000",), value=v)
        for i, (n, v) in enumerate([("a", 5), ("b", 5), ("c", 9)], start=1)
    ]
    assert next_to_go(listed, lambda pod: pod.value) == {
        "10.0.0.1:8000": 0.0,
        "10.0.0.2:8000": 0.0,
        "10.0.0.3:8000": 1.0,
    }
    unknown = [PodRef("ns", n, (f"{n}:8000",)) for n in ("a", "b", "c")]
    assert next_to_go(unknown, lambda pod: pod.value) == {}
