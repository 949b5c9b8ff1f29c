"""Metrics of one replica: vLLM's names and labels, plus `sim_` counters only the simulator has.

Call sites bump plain ints and tiny histograms (`SimStats`); a custom prometheus_client collector in a
per-replica CollectorRegistry turns them into families at scrape time, so the per-token path never
touches a prometheus_client lock. vLLM semantics kept: client aborts are NOT counted in
`vllm:request_success_total{finished_reason="abort"}` nor in the e2e histogram; shutdown aborts are.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from vllm_sim.config import CacheConfig
from vllm_sim.engine import Engine

# vLLM's bucket boundaries (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)

# How late a chunk is written after its deadline (simulator only; measures the simulator, not the client).
LATENESS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)

FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
LABELS = ("engine", "model_name")
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


class Histogram:
    """A lock-free histogram for one event loop."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            running += count
            out.append((repr(float(bound)), running))
        out.append(("+Inf", running + self.counts[-1]))
        return out


class SimStats:
    """Every counter of one replica, as plain numbers."""

    def __init__(self) -> None:
        self.created = time.time()
        self.received = 0
        self.served = 0
        self.aborted = 0
        self.prompt_tokens = 0
        # vLLM's prompt-token sources: local_compute, local_cache_hit, external_kv_transfer (a decode's pull)
        self.prompt_by_source: Counter[str] = Counter()
        self.generation_tokens = 0
        self.admission_rejections = 0
        self.rejected: Counter[str] = Counter()
        self.ended: Counter[str] = Counter()
        self.success: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_BUCKETS)
        self.queue_time = Histogram(REQUEST_BUCKETS)
        self.lateness = Histogram(LATENESS_BUCKETS)


class SimCollector(Collector):
    def __init__(
        self,
        model: str,
        engine: Engine,
        stats: SimStats,
        in_flight: Callable[[], int],
        draining: Callable[[], bool],
        cache: CacheConfig | None = None,
    ) -> None:
        self._labels = ["0", model]
        self._cache = cache or CacheConfig()
        self._engine = engine
        self._stats = stats
        self._in_flight = in_flight
        self._draining = draining

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, value, created=self._stats.created)
        return family

    def _histogram(self, name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=LABELS)
        family.add_metric(self._labels, hist.buckets(), hist.total)
        return family

    def collect(self) -> Iterable[Metric]:
        engine, stats = self._engine, self._stats
        yield self._gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running)
        )
        yield self._gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting)
        )
        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason", "Waiting requests by reason.", labels=(*LABELS, "reason")
        )
        by_reason.add_metric([*self._labels, "capacity"], len(engine.waiting))
        by_reason.add_metric([*self._labels, "deferred"], 0)
        yield by_reason
        yield self._gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engine.kv_usage
        )
        yield from self._cache_families()
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"),
        )
        for reason in FINISHED_REASONS:
            success.add_metric([*self._labels, reason], stats.success[reason], created=stats.created)
        yield success
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens)
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", labels=(*LABELS, "source")
        )
        for source in PROMPT_SOURCES:
            by_source.add_metric(
                [*self._labels, source], stats.prompt_by_source[source], created=stats.created
            )
        yield by_source
        yield self._counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens
        )
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemptions.", 0)
        rejections = CounterMetricFamily(
            "vllm:admission_rejections", "Requests rejected at admission.", labels=("reason",)
        )
        rejections.add_metric(["max_num_queued_reqs"], stats.admission_rejections, created=stats.created)
        yield rejections
        yield self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token.", stats.ttft
        )
        yield self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency.", stats.itl
        )
        yield self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", stats.e2e
        )
        yield self._histogram(
            "vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", stats.queue_time
        )
        yield from self._sim_families()

    def _cache_families(self) -> Iterable[Metric]:
        """Prefix caching and LoRA, as vLLM 0.32 names them."""
        engine, stats = self._engine, self._stats
        prefix = engine.prefix
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=("block_size", "enable_prefix_caching", "num_gpu_blocks", "engine"),
        )
        blocks = prefix.num_blocks if prefix is not None else 0
        info.add_metric([str(self._cache.block_size), str(prefix is not None), str(blocks), "0"], 1.0)
        yield info
        yield self._counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in tokens.",
            prefix.queries if prefix is not None else 0,
        )
        yield self._counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in tokens.",
            prefix.hits if prefix is not None else 0,
        )
        yield self._counter(
            "vllm:prompt_tokens_cached",
            "Number of cached prompt tokens.",
            prefix.hits if prefix is not None else 0,
        )
        if self._cache.lora_modules:
            lora = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            )
            lora.add_metric(
                [
                    str(self._cache.max_loras),
                    ",".join(sorted(engine.active_loras)),
                    ",".join(sorted(engine.waiting_loras)),
                ],
                stats.created if not engine.active_loras else time.time(),
            )
            yield lora

    def _sim_families(self) -> Iterable[Metric]:
        stats = self._stats
        for name, doc, value in (
            ("sim_requests_received", "Completion requests received.", stats.received),
            ("sim_requests_served", "Completion requests that finished with stop or length.", stats.served),
            ("sim_requests_aborted", "Requests ended by a client disconnect.", stats.aborted),
        ):
            family = CounterMetricFamily(name, doc)
            family.add_metric([], value, created=stats.created)
            yield family
        for name, doc, counts, label in (
            (
                "sim_requests_rejected",
                "Requests answered with an error before any token.",
                stats.rejected,
                "reason",
            ),
            ("sim_requests_ended", "Requests by outcome (see the request log).", stats.ended, "outcome"),
        ):
            family = CounterMetricFamily(name, doc, labels=(label,))
            for key in sorted(counts):
                family.add_metric([key], counts[key], created=stats.created)
            yield family
        lateness = HistogramMetricFamily(
            "sim_token_lateness_seconds", "How late each chunk was written after its deadline."
        )
        lateness.add_metric([], stats.lateness.buckets(), stats.lateness.total)
        yield lateness
        yield GaugeMetricFamily(
            "sim_requests_in_flight", "Completion requests inside the replica.", value=self._in_flight()
        )
        yield GaugeMetricFamily("sim_draining", "1 once a shutdown began.", value=int(self._draining()))


def make_registry(collector: SimCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
