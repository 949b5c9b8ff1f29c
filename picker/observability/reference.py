"""The reference endpoint picker's metric names (Gateway API Inference Extension), beside the picker's own.

A team that swaps the reference's image for this one keeps its dashboards and alerts: the names, types
and label names are the reference's. One recording per fact: a fact the picker already records (time to
first token, admission-and-pick time, queue wait, queue size, per-replica engine gauges) is read from
that recording, or from the pool, when /metrics is scraped and shown again under the reference's name
(its buckets are then the picker's); a fact the picker did not record before
(requests and errors by model, request duration, sizes, token counts, time per output token) is
recorded once, under the reference's name, and the picker's own name derived from it where it has one
(`picker_output_tokens_total` is the `_sum` of `inference_objective_output_tokens`).

The pool's saturation is the reference's figure, not `picker_pool_saturation` (demand over ready slots,
unknown while a replica's slot count is): the mean over READY replicas of the larger of engine queue
over `load.waiting_threshold` and KV-cache usage over `load.kv_threshold`, a replica without fresh
figures counting 1, no READY replica 1. It is read from the pool at scrape time, with the thresholds
the pick calls an engine saturated by, so it answers whenever the engines are scraped.

Labels as the reference sets them. The picker rewrites no model names, so `target_model_name` is
`model_name`; model names come from requests and are capped as the picker's own (`other` past the cap).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from picker.contract import Outcome
from picker.pool import Endpoint, EndpointState, Pool
from picker.scheduling.load import LoadPolicy

# The reference's buckets for the facts recorded here (pkg/epp/metrics/metrics.go).
LATENCY_BUCKETS = (
    *(0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30),
    *(45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600),
)
TPOT_BUCKETS = (
    *(0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270, 360),
)
REQUEST_SIZE_BUCKETS = tuple(float(2**n) for n in range(6, 31))  # 64 B .. 1 GiB
RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
INPUT_TOKEN_BUCKETS = (*(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778), 65536)
INPUT_TOKEN_BUCKETS += (131072, 262144, 524288, 1048576)
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

_MODEL = ["model_name", "target_model_name"]

# The reference's error_code (its error package's codes) for each refusal of the status contract.
ERROR_CODES: dict[Outcome, str] = {
    Outcome.REJECTED_SATURATED: "ResourceExhausted",
    Outcome.REJECTED_TTL_EXPIRED: "ResourceExhausted",
    Outcome.REJECTED_NO_ENDPOINTS: "ServiceUnavailable",
    Outcome.REJECTED_SHUTTING_DOWN: "ServiceUnavailable",
    Outcome.REJECTED_CONTEXT_CANCELLED: "Unknown",
    Outcome.REJECTED_MODEL_NOT_SERVED: "NotFound",
    Outcome.REJECTED_CONTEXT_TOO_LONG: "BadRequest",
    Outcome.REJECTED_SLO_UNATTAINABLE: "ResourceExhausted",
    Outcome.BAD_REQUEST: "BadRequest",
    Outcome.TOO_LARGE: "BadRequest",
    Outcome.INTERNAL_ERROR: "Internal",
    Outcome.PICKER_UNAVAILABLE: "ServiceUnavailable",
}

# The reference's flow-control outcome for each admission outcome (its QueueOutcome names).
QUEUE_OUTCOMES: dict[str, str] = {
    Outcome.DISPATCHED.value: "Dispatched",
    Outcome.REJECTED_SATURATED.value: "RejectedCapacity",
    Outcome.REJECTED_TTL_EXPIRED.value: "EvictedTTL",
    Outcome.REJECTED_CONTEXT_CANCELLED.value: "EvictedContextCancelled",
    Outcome.REJECTED_SHUTTING_DOWN.value: "EvictedOther",
    Outcome.REJECTED_NO_ENDPOINTS.value: "EvictedOther",
}


class Labels(Protocol):
    """The picker's capped model labels (metrics.py's _CappedLabels)."""

    def label(self, value: str) -> str: ...


class Recorded(Protocol):
    """A metric of the picker's own registry whose samples are shown again (a Histogram)."""

    def collect(self) -> list[Metric]: ...


class ReferenceSeries:
    """The facts recorded under the reference's names, each child looked up once per model."""

    def __init__(self, registry: CollectorRegistry, models: Labels, histogram: type[Histogram]) -> None:
        r, self._models = registry, models

        def _histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return histogram(
                f"inference_objective_{name}", doc + ", by model", _MODEL, buckets=buckets, registry=r
            )

        self.requests = Counter(
            "inference_objective_request_total",
            "Requests picked for a replica, by model and priority (the reference's count)",
            [*_MODEL, "priority"],
            registry=r,
        )
        self.errors = Counter(
            "inference_objective_request_error_total",
            "Requests the picker refused, by model and the reference's error_code",
            [*_MODEL, "error_code"],
            registry=r,
        )
        self.duration = _histogram(
            "request_duration_seconds", "Admission to the response's end", LATENCY_BUCKETS
        )
        self.tpot = _histogram(
            "request_tpot_seconds",
            "Per request: first token to end over output tokens after the first",
            TPOT_BUCKETS,
        )
        self.request_sizes = _histogram("request_sizes", "Request body bytes", REQUEST_SIZE_BUCKETS)
        self.response_sizes = _histogram("response_sizes", "Response body bytes seen", RESPONSE_SIZE_BUCKETS)
        self.input_tokens = _histogram(
            "input_tokens", "Prompt tokens (the engine's usage)", INPUT_TOKEN_BUCKETS
        )
        self.output_tokens = _histogram(
            "output_tokens", "Output tokens per request (usage, else token chunks)", OUTPUT_TOKEN_BUCKETS
        )
        self._children: dict[tuple[str, str], Histogram | Counter] = {}

    def _child(self, kind: str, metric: Histogram | Counter, model: str, *extra: str) -> Histogram | Counter:
        key = (kind, model + "\0" + "\0".join(extra))
        child = self._children.get(key)
        if child is None:
            label = self._models.label(model)
            child = metric.labels(label, label, *extra)
            if len(self._children) < 1024:  # model names come from requests: the cache is bounded too
                self._children[key] = child
        return child

    def picked(self, model: str, priority: int) -> None:
        self._child("requests", self.requests, model, str(priority)).inc()  # type: ignore[union-attr]

    def refused(self, model: str, outcome: Outcome) -> None:
        code = ERROR_CODES.get(outcome)
        if code is not None:
            self._child("errors", self.errors, model, code).inc()  # type: ignore[union-attr]

    def produced(self, model: str, tokens: int) -> None:
        """The tokens one request streamed (`picker_output_tokens_total` is this histogram's sum)."""
        if tokens > 0:
            self._child("output_tokens", self.output_tokens, model).observe(tokens)  # type: ignore[union-attr]

    def ended(
        self,
        model: str,
        *,
        duration_s: float,
        request_bytes: int,
        response_bytes: int,
        prompt_tokens: int | None,
        tpot_s: float | None,
    ) -> None:
        """One dispatched request's end, once (its output tokens: `produced`)."""
        child = self._child
        child("duration", self.duration, model).observe(duration_s)  # type: ignore[union-attr]
        child("request_sizes", self.request_sizes, model).observe(request_bytes)  # type: ignore[union-attr]
        child("response_sizes", self.response_sizes, model).observe(response_bytes)  # type: ignore[union-attr]
        if prompt_tokens:
            child("input_tokens", self.input_tokens, model).observe(prompt_tokens)  # type: ignore[union-attr]
        if tpot_s is not None:
            child("tpot", self.tpot, model).observe(tpot_s)  # type: ignore[union-attr]


def _renamed(
    source: Recorded, name: str, doc: str, relabel: Callable[[dict[str, str]], dict[str, str]]
) -> Metric:
    """`source`'s histogram samples under `name`, labels mapped by `relabel`; samples whose mapped
    labels coincide are summed (several picker outcomes are one reference outcome)."""
    family = Metric(name, doc, "histogram")
    sums: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for metric in source.collect():
        for sample in metric.samples:
            suffix = sample.name[len(metric.name) :]
            if suffix not in ("_bucket", "_sum", "_count"):
                continue
            labels = relabel({k: v for k, v in sample.labels.items() if k != "le"})
            if "le" in sample.labels:
                labels["le"] = sample.labels["le"]
            key = (suffix, tuple(labels.items()))
            sums[key] = sums.get(key, 0.0) + sample.value
    for (suffix, labels), value in sums.items():
        family.add_sample(name + suffix, dict(labels), value)
    return family


def pool_saturation(endpoints: Iterable[Endpoint], policy: LoadPolicy, now: float) -> float:
    """The reference's pool saturation (its utilization detector): the mean over READY replicas of
    max(engine queue / waiting_threshold, KV usage / kv_threshold); a replica whose figures are
    missing or older than staleness_s counts 1 (never idle), and a pool with no READY replica is 1."""
    total, count = 0.0, 0
    for endpoint in endpoints:
        if endpoint.state is not EndpointState.READY:
            continue
        count += 1
        load = endpoint.load
        if load is None or now - load.at > policy.staleness_s:
            total += 1.0
        else:
            total += max(load.waiting / policy.waiting_threshold, load.kv_usage / policy.kv_threshold)
    return total / count if count else 1.0


def build_commit() -> str:
    """The commit the installed package was built from, where the installer recorded one (PEP 610:
    installed from a VCS URL); blank otherwise (the version alone names no commit)."""
    try:
        text = importlib.metadata.distribution("inference-picker").read_text("direct_url.json")
        commit = json.loads(text or "{}").get("vcs_info", {}).get("commit_id", "")
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return ""
    return commit if isinstance(commit, str) else ""


class FlowFigures(Protocol):
    @property
    def queued(self) -> int: ...

    @property
    def queued_bytes(self) -> int: ...


class ReferenceViews(Collector):
    """The reference's series read at scrape time from the picker's state and recordings."""

    def __init__(
        self,
        pool_name: str,
        models: Labels,
        ttft: Recorded,
        pick: Recorded,
        queue_wait: Recorded,
        output_tokens: Recorded,
        bounded: Callable[[str], str],
    ) -> None:
        self._name, self._models, self._bounded = pool_name, models, bounded
        self._ttft, self._pick, self._queue_wait, self._output_tokens = ttft, pick, queue_wait, output_tokens
        self.pool: Pool | None = None
        self.flow: FlowFigures | None = None
        self.running: Callable[[], Iterable[str]] | None = None
        # the pick's thresholds (load.*), set by the request path; None or scraping off: no saturation
        self.policy: LoadPolicy | None = None
        self.clock: Callable[[], float] = time.monotonic
        self._commit = build_commit()
        try:
            self._version = importlib.metadata.version("inference-picker")
        except importlib.metadata.PackageNotFoundError:
            self._version = "unknown"

    def collect(self) -> Iterator[Metric]:
        yield from self._pool_gauges()
        yield from self._objective_views()
        yield from self._flow_views()
        info = Metric(
            "inference_extension_info",
            "The picker's build: its version, and its commit where the installer recorded one",
            "gauge",
        )
        info.add_sample("inference_extension_info", {"commit": self._commit, "build_ref": self._version}, 1.0)
        yield info

    def _pool_gauges(self) -> Iterator[Metric]:
        pool, name = self.pool, {"name": self._name}
        if pool is None:
            return
        endpoints = pool.endpoints()
        loads = [e.load for e in endpoints if e.load is not None and e.state is not EndpointState.GONE]
        per_pod = Metric(
            "inference_pool_per_pod_queue_size", "Requests waiting in each replica's engine queue", "gauge"
        )
        for endpoint in endpoints:
            if endpoint.load is not None and endpoint.state is not EndpointState.GONE:
                pod = {"name": self._name, "model_server_pod": self._bounded(endpoint.address)}
                per_pod.add_sample(per_pod.name, pod, float(endpoint.load.waiting))
        for metric, doc, value in (
            ("average_kv_cache_utilization", "Mean engine KV-cache usage (0-1)", lambda load: load.kv_usage),
            ("average_queue_size", "Mean engine queue", lambda load: load.waiting),
            ("average_running_requests", "Mean engine running requests", lambda load: load.running),
        ):
            family = Metric(f"inference_pool_{metric}", doc + " over the pool's scraped replicas", "gauge")
            if loads:
                family.add_sample(family.name, name, sum(float(value(x)) for x in loads) / len(loads))
            yield family
        ready = Metric("inference_pool_ready_pods", "READY replicas of the pool", "gauge")
        ready.add_sample(ready.name, name, float(sum(1 for e in endpoints if e.state is EndpointState.READY)))
        yield ready
        yield per_pod

    def _objective_views(self) -> Iterator[Metric]:
        def model_labels(labels: dict[str, str]) -> dict[str, str]:
            model = labels.get("model", "")
            return {"model_name": model, "target_model_name": model}

        yield _renamed(
            self._ttft, "inference_objective_request_ttft_seconds", "Admission to first byte", model_labels
        )
        yield _renamed(
            self._pick, "inference_extension_scheduler_e2e_duration_seconds", "Admit and pick", lambda _: {}
        )
        running = Metric("inference_objective_running_requests", "Requests in flight, by model", "gauge")
        counts: dict[str, int] = {}
        for model in self.running() if self.running is not None else ():
            label = self._models.label(model)
            counts[label] = counts.get(label, 0) + 1
        for label, count in sorted(counts.items()):
            running.add_sample(running.name, {"model_name": label}, float(count))
        yield running
        tokens = Metric("picker_output_tokens", "Tokens streamed to clients, by model", "counter")
        for metric in self._output_tokens.collect():
            for sample in metric.samples:
                if sample.name.endswith("_sum"):
                    tokens.add_sample(
                        "picker_output_tokens_total", {"model": sample.labels["model_name"]}, sample.value
                    )
        yield tokens

    def _flow_views(self) -> Iterator[Metric]:
        pool = {"inference_pool": self._name}
        saturation = Metric(
            "inference_extension_flow_control_pool_saturation",
            "The reference's pool saturation: mean over READY replicas of max(engine queue / "
            "load.waiting_threshold, KV usage / load.kv_threshold), 1 for a replica without fresh "
            "figures or a pool without READY replicas; absent with load.scrape off",
            "gauge",
        )
        policy = self.policy
        if self.pool is not None and policy is not None and policy.use_metrics:
            value = pool_saturation(self.pool.endpoints(), policy, self.clock())
            saturation.add_sample(saturation.name, dict(pool), value)
        yield saturation
        flow_labels = {"fairness_id": "", "priority": "", **pool, "model_name": "", "target_model_name": ""}
        for name, doc, value in (
            ("queue_size", "Requests waiting in the admission queue", lambda f: f.queued),
            ("queue_bytes", "Request bytes waiting in the admission queue", lambda f: f.queued_bytes),
        ):
            family = Metric(f"inference_extension_flow_control_{name}", doc, "gauge")
            if self.flow is not None:
                family.add_sample(family.name, flow_labels, float(value(self.flow)))
            yield family

        def queue_labels(labels: dict[str, str]) -> dict[str, str]:
            outcome = QUEUE_OUTCOMES.get(labels.get("outcome", ""), "RejectedOther")
            return {**flow_labels, "outcome": outcome}

        yield _renamed(
            self._queue_wait,
            "inference_extension_flow_control_request_queue_duration_seconds",
            "Time in the admission queue, by the reference's outcome",
            queue_labels,
        )
        dispatched = {"fairness_id": "", "priority": "", "outcome": "Dispatched"}
        yield _renamed(
            self._pick,
            "inference_extension_flow_control_request_enqueue_duration_seconds",
            "Admit and pick: the picker enqueues and dispatches in one step",
            lambda _: dict(dispatched),
        )
        yield _renamed(
            self._pick,
            "inference_extension_flow_control_dispatch_cycle_duration_seconds",
            "Admit and pick: a dispatch is one pick",
            lambda _: {},
        )
