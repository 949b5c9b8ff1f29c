"""The reference's series read at scrape time from the picker's state and its own recordings."""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from picker.contract import Outcome
from picker.observability.reference.recorded import Labels
from picker.pool import Endpoint, EndpointState, Pool
from picker.scheduling.load import LoadPolicy

# The reference's flow-control outcome for each admission outcome (its QueueOutcome names).
QUEUE_OUTCOMES: dict[str, str] = {
    Outcome.DISPATCHED.value: "Dispatched",
    Outcome.REJECTED_SATURATED.value: "RejectedCapacity",
    Outcome.REJECTED_TTL_EXPIRED.value: "EvictedTTL",
    Outcome.REJECTED_CONTEXT_CANCELLED.value: "EvictedContextCancelled",
    Outcome.REJECTED_SHUTTING_DOWN.value: "EvictedOther",
    Outcome.REJECTED_NO_ENDPOINTS.value: "EvictedOther",
}


class Recorded(Protocol):
    """A metric of the picker's own registry whose samples are shown again (a Histogram)."""

    def collect(self) -> list[Metric]: ...


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
        output_tokens: Callable[[], Iterable[tuple[str, float]]],
        bounded: Callable[[str], str],
    ) -> None:
        self._name, self._models, self._bounded = pool_name, models, bounded
        self._ttft, self._pick, self._queue_wait, self._output_tokens = ttft, pick, queue_wait, output_tokens
        self.pool: Pool | None = None
        self.flow: FlowFigures | None = None
        self.running: Callable[[], Iterable[str]] | None = None
        # tenants.fair_share on: requests queued by tenant label (picker_tenant_queued's rows)
        self.queued_by_tenant: Callable[[], dict[str, float]] | None = None
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
        for label, total in self._output_tokens():
            tokens.add_sample("picker_output_tokens_total", {"model": label}, total)
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
        size = Metric(
            "inference_extension_flow_control_queue_size",
            "Requests waiting in the admission queue (by fairness_id with tenants.fair_share on; blank: "
            "requests without one)",
            "gauge",
        )
        queued_bytes = Metric(
            "inference_extension_flow_control_queue_bytes",
            "Request bytes waiting in the admission queue",
            "gauge",
        )
        if self.flow is not None:
            queued = float(self.flow.queued)
            tenants = self.queued_by_tenant() if self.queued_by_tenant is not None else {}
            for tenant, count in tenants.items():
                size.add_sample(size.name, {**flow_labels, "fairness_id": tenant}, count)
            size.add_sample(size.name, flow_labels, max(0.0, queued - sum(tenants.values())))
            queued_bytes.add_sample(queued_bytes.name, flow_labels, float(self.flow.queued_bytes))
        yield size
        yield queued_bytes

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
