"""Every metric family the picker can export, optional ones included, each registered once over
stand-in views: for the generated metrics page, and for `picker check`, which holds an autoscaler's
query to metrics that exist (a renamed family breaks the query before it breaks the scaling)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from picker.contract import Outcome
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.load import LoadSample
from picker.scheduling.latency import LatencyModel
from picker.scheduling.load import LoadPolicy
from picker.scheduling.signals import PoolFigures
from picker.streams.ends import DataPlanes


@dataclass
class _Flow:
    queued: int = 0
    queued_bytes: int = 0


@dataclass
class _Peers:
    peers: tuple[str, ...] = ("127.0.0.1:9005",)
    connected: set[str] = field(default_factory=set)
    forwarded: int = 0
    applied: int = 0
    unknown: int = 0
    observers: int = 0
    dropped: int = 0
    orphans: int = 0
    superseded_total: int = 0
    known_connections: int = 0


@dataclass
class _Canary:
    phase: str = "progressing"
    weight: int = 0
    rollbacks: int = 0
    totals: dict[str, int] = field(default_factory=lambda: {"stable": 0, "candidate": 0})


def every_family(pool_label: str = "default") -> Metrics:
    """A Metrics with every optional family registered; each per-pool gauge holds one sample."""
    metrics = Metrics(CollectorRegistry(), pool=pool_label)
    pool = Pool()
    pool.apply(ready=["10.0.0.1:8000"])
    replica = pool.get("10.0.0.1:8000")
    assert replica is not None
    replica.load = LoadSample(
        running=0, waiting=0, kv_usage=0.0, at=0.0, arrivals_before=0, departures_after=0
    )
    metrics.register_pool(pool)
    _reference_samples(metrics)
    metrics.register_flow(_Flow())
    metrics.register_peers(_Peers())
    metrics.set_leader(False)
    metrics.register_capacity(lambda: PoolFigures(0, 0.0, 0.0, 0, 0.0))
    metrics.register_deletion_cost(lambda: (False, {}, {}))
    metrics.register_pool_status(lambda: (False, {}, {}))
    metrics.register_metrics_auth(lambda: {("tokenreview", "authenticated"): 0})
    metrics.register_rejections("drain_record", lambda: {"unknown-cause": 0})
    metrics.register_latency(LatencyModel())
    metrics.register_data_planes(DataPlanes())
    metrics.register_rollout(_Canary())
    return metrics


def _reference_samples(metrics: Metrics) -> None:
    """One sample in each of the reference's families, so that the page shows their labels."""
    metrics.register_running(lambda: ("model",))
    metrics.register_load_policy(LoadPolicy(), lambda: 0.0)
    metrics.reference.picked("model", 0)
    metrics.reference.refused("model", Outcome.REJECTED_SATURATED)
    metrics.reference.produced("model", 1)
    metrics.reference.ended(
        "model", duration_s=0.0, request_bytes=0, response_bytes=0, prompt_tokens=1, tpot_s=0.0
    )
    metrics.observe_ttft("model", 0.0)
    metrics.count_admission(Outcome.DISPATCHED, 0.0)


def exported_names() -> frozenset[str]:
    """Every sample name a scrape can show (counters' `_total`, histograms' `_bucket` ...)."""
    names: set[str] = set()
    for family in every_family().registry.collect():
        names.add(family.name)
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(family.type, ())
        names.update(family.name + suffix for suffix in suffixes)
    return frozenset(names)
