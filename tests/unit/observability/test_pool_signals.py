"""The per-pool autoscaling gauges on the metrics page (issue 55, item 2): labelled by pool only,
absent (not 0) where a figure is unknown, and every documented query names a family that exists."""

from __future__ import annotations

import math
import re

from prometheus_client.parser import text_string_to_metric_families

from picker.config.model import PickerConfig
from picker.observability.families import exported_names
from picker.observability.metrics import AUTOSCALING_QUERIES, Metrics
from picker.scheduling.signals import PoolFigures


def samples(metrics: Metrics) -> dict[str, tuple[dict[str, str], float]]:
    page = metrics.exposition().decode()
    return {
        s.name: (s.labels, s.value)
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name.startswith("picker_pool_")
    }


def test_the_gauges_carry_the_pool_label_only() -> None:
    metrics = Metrics(pool="vllm-llama")
    metrics.register_capacity(lambda: PoolFigures(12, 9.0, 0.75, 1, 2.5))
    seen = samples(metrics)
    assert seen == {
        "picker_pool_ready_capacity": ({"pool": "vllm-llama"}, 12.0),
        "picker_pool_demand": ({"pool": "vllm-llama"}, 9.0),
        "picker_pool_saturation": ({"pool": "vllm-llama"}, 0.75),
        "picker_pool_removable_replicas": ({"pool": "vllm-llama"}, 1.0),
        "picker_pool_predicted_wait_seconds": ({"pool": "vllm-llama"}, 2.5),
    }


def test_a_non_finite_figure_is_never_exported() -> None:
    """An autoscaler cannot use +Inf or NaN (prometheus-adapter: int64(v * 1000)): left out."""
    metrics = Metrics(pool="vllm-llama")
    metrics.register_capacity(lambda: PoolFigures(12, 9.0, math.nan, 1, math.inf))
    assert set(samples(metrics)) == {
        "picker_pool_ready_capacity",
        "picker_pool_demand",
        "picker_pool_removable_replicas",
    }


def test_unknown_figures_are_absent_not_zero() -> None:
    """An autoscaler reading 0 for "unknown" would scale the pool down: the series is left out."""
    metrics = Metrics(pool="default")
    metrics.register_capacity(lambda: PoolFigures(None, 3.0, None, None, None))
    assert samples(metrics) == {"picker_pool_demand": ({"pool": "default"}, 3.0)}


def test_the_figures_are_read_at_scrape_time_only() -> None:
    reads: list[int] = []

    def read() -> PoolFigures:
        reads.append(1)
        return PoolFigures(4, float(len(reads)), 0.25, 0, 0.0)

    metrics = Metrics(pool="default")
    metrics.register_capacity(read)
    assert reads == []
    assert samples(metrics)["picker_pool_demand"][1] == 1.0
    assert samples(metrics)["picker_pool_demand"][1] == 2.0


def test_the_pool_label_defaults_to_the_pool_the_picker_reads() -> None:
    assert PickerConfig().pool_label() == "default"
    assert PickerConfig(kube={"pool_name": "vllm-llama"}).pool_label() == "vllm-llama"
    assert PickerConfig(kube={"service": "vllm"}).pool_label() == "vllm"
    named = PickerConfig(kube={"pool_name": "a"}, autoscaling={"pool_label": "b"})
    assert named.pool_label() == "b"


def test_every_documented_query_reads_its_own_family_and_that_family_exists() -> None:
    names = exported_names()
    for family, (what, query) in AUTOSCALING_QUERIES.items():
        assert family in names, family
        assert re.findall(r"picker_[a-z_]+", query) == [family], query
        assert '{pool="$POOL"}' in query and what
    assert "picker_pool_saturation" in names and "picker_ready_capacity" not in names
    assert {"picker_request_ends_total", "picker_flow_wait_seconds_bucket"} <= names
