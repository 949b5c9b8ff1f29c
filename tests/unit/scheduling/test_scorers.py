"""The pick as rows, filters and scorers (issue 54): each scorer alone, the registration table against
the configuration and the reference's plugin types, the filters, and a pick that builds each row once."""

from __future__ import annotations

import random

import pytest

from picker.config.model import AffinityConfig
from picker.config.plugins import APPLIED
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.placement import Placement
from picker.scheduling import LoadPolicy, filters, rows, scorers
from picker.scheduling import load as load_module
from picker.scheduling.choice import AffinityPolicy, choose
from picker.scheduling.rows import Row
from picker.scheduling.scorers import SCORERS, Spans
from picker.streams import RequestRecord

POLICY = AffinityPolicy.of(AffinityConfig())


def row(address: str = "a", **figures: float | bool | None) -> Row:
    out = Row(
        address, False, False, False, float(figures.pop("cost", 0.0)), 0.0, float(figures.pop("load", 0.0))
    )
    for name, value in figures.items():
        setattr(out, name, value)
    return out


def spans(table: list[Row], near: list[Row] | None = None, predicted: bool = False) -> Spans:
    return Spans.of(table, table if near is None else near, predicted)


def test_prefix_scores_the_cached_share_only_within_the_load_gap() -> None:
    holder, far = row("a", cached=0.75), row("b", cached=1.0)
    table = [holder, far]
    assert scorers.prefix(holder, spans(table, [holder])) == 0.75
    assert scorers.prefix(far, spans(table, [holder])) == 0.0


def test_load_is_min_max_over_the_rows_with_room() -> None:
    table = [row("a", cost=1.0), row("b", cost=3.0), row("c", cost=5.0)]
    assert [scorers.load(r, spans(table)) for r in table] == [1.0, 0.5, 0.0]
    same = [row("a", cost=2.0), row("b", cost=2.0)]
    assert [scorers.load(r, spans(same)) for r in same] == [1.0, 1.0]


def test_lora_and_room_read_their_row() -> None:
    r = row(lora=0.8, room=0.25)
    assert scorers.lora(r, spans([r])) == 0.8
    assert scorers.room(r, spans([r])) == 0.25


def test_latency_is_min_max_over_the_predictions() -> None:
    table = [row("a", latency_s=0.2), row("b", latency_s=0.4), row("c", latency_s=0.6)]
    assert [scorers.latency(r, spans(table, predicted=True)) for r in table] == pytest.approx([1.0, 0.5, 0.0])
    flat = [row("a", latency_s=0.3), row("b", latency_s=0.3)]
    assert [scorers.latency(r, spans(flat, predicted=True)) for r in flat] == [1.0, 1.0]


def test_every_scorer_is_weighed_by_a_setting_and_named_by_the_reference_plugins_that_set_it() -> None:
    config = AffinityConfig()
    for name, registered in SCORERS.items():
        assert isinstance(getattr(config, registered.weight), float), name
        for plugin in registered.plugins:
            assert registered.weight in APPLIED[plugin], (name, plugin)


def test_a_zero_weight_drops_a_scorer_and_predictions_add_the_latency_scorer() -> None:
    plain = AffinityPolicy.of(AffinityConfig(room_weight=0.0, latency=True))
    assert scorers.room not in [scorer for scorer, _ in plain.scored]
    assert scorers.latency not in [scorer for scorer, _ in plain.scored]
    assert (scorers.latency, 4.0) in plain.scored_predicted
    off = AffinityPolicy.of(AffinityConfig(latency="off"))
    assert scorers.latency not in [scorer for scorer, _ in off.scored_predicted]


def test_filters() -> None:
    a, b, c = row("a", load=0.0), row("b", load=4.0), row("c", load=9.0)
    assert filters.in_range([a, b, c], POLICY) == [a, b]  # within 4 requests of the least
    hot = row("a", load=0.0, load_avg=10.0)
    assert filters.in_range([hot, row("b", load=1.0)], POLICY)[0].address == "b"  # out of balance
    full = row("d")
    full.full = True
    assert filters.with_room([a, full]) == [a]
    assert filters.lora_tier([row("a", lora=0.8), row("b", lora=1.0)])[0].address == "b"
    assert filters.holders([row("a", cached=0.4), row("b", cached=0.6)], 0.5)[0].address == "b"
    quick, slow = row("a", ttft_s=0.05, latency_s=0.4), row("b", ttft_s=0.05, latency_s=1.2)
    assert filters.quick([quick, slow], POLICY, None) == [quick]
    assert filters.quick([quick, slow], POLICY, (0.01, None)) == [quick]  # none meets it: the quickest


def test_a_pick_builds_each_row_once_and_the_choice_reads_only_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = Pool()
    pool.apply(ready=["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"])
    for n, endpoint in enumerate(pool.endpoints()):
        record_sample(endpoint, running=n, waiting=0, kv_usage=0.1, now=0.0)
    placement = Placement(pool, AffinityConfig(latency=True), Metrics(pool="default"), None)
    request = InferenceRequest(
        method="POST", path="/v1/completions", model="m", stream=True, prompt=b"x" * 4000
    )
    record = RequestRecord(request_id="r", admitted_at=0.0, keys=placement.keys(request, None, None))
    calls: list[str] = []
    measure, predict = rows.measure, rows.predict
    counting = lambda c, *a: calls.append(f"load {c.address}") or measure(c, *a)  # noqa: E731
    monkeypatch.setattr(rows, "measure", counting)
    monkeypatch.setattr(load_module, "measure", counting)  # what `assess` and `busy` would ask
    monkeypatch.setattr(
        rows, "predict", lambda m, c, *a: calls.append(f"model {c.address}") or predict(m, c, *a)
    )
    choice = placement.choose(record, pool.ready(), 3, random.Random(1), 0.5, LoadPolicy(), frozenset())
    assert choice is not None and choice.primary is not None
    assert sorted(calls) == sorted(
        f"{kind} 10.0.0.{n}:8000" for n in range(1, 5) for kind in ("load", "model")
    )
    assert choice.destinations[0] == choice.primary.address == "10.0.0.1:8000"  # the least loaded
    again = choose([choice.primary], 1, placement.policy)
    assert again.destinations == [choice.primary.address]
