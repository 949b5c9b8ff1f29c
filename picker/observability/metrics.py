"""Every Prometheus metric the picker exports, and the small typed helpers call sites use.

One registry per picker instance (tests run several in one process). Per-endpoint gauges are read
from the pool at scrape time, so the request path never touches a gauge.
Longer than 400 lines on purpose: the one owner of every metric name, help text and label set (the
documentation's metrics page is generated from its registry).
"""

from __future__ import annotations

import json
import logging
import math
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from picker.contract import Outcome
from picker.flow import tenant_view
from picker.flow.budgets import Budgets
from picker.flow.tenants import Tenants
from picker.observability.reference import ReferenceSeries, ReferenceViews
from picker.pool import DrainEnd, DrainExit, DrainRecord, Endpoint, EndpointState, Pool
from picker.scheduling.latency import LatencyModel
from picker.scheduling.load import LoadPolicy, books_gap
from picker.scheduling.signals import PoolFigures
from picker.streams import EndReason
from picker.streams.ends import DataPlanes, Ends
from picker.streams.record import RequestRecord, Slo

# `_created` samples double every counter's page size and nobody reads them.
disable_created_metrics()

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PICK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)
_DRAIN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)


class _PoolCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "picker_endpoint_in_flight",
            "Requests the picker has in flight on each endpoint",
            labels=["endpoint"],
        )
        peer_in_flight = GaugeMetricFamily(
            "picker_endpoint_peer_in_flight",
            "Requests the other pickers (peers.members) have in flight on each endpoint",
            labels=["endpoint"],
        )
        state = GaugeMetricFamily(
            "picker_endpoint_state", "1 for the endpoint's current state", labels=["endpoint", "state"]
        )
        role = GaugeMetricFamily(
            "picker_endpoint_role",
            "1 for the endpoint's role in a prefill / decode pool (invalid: its role label names none)",
            labels=["endpoint", "role"],
        )
        pulls = GaugeMetricFamily(
            "picker_endpoint_kv_pulls_pending",
            "Prefill hand-offs on each endpoint whose KV no decode replica has pulled yet",
            labels=["endpoint"],
        )
        engine = {
            name: GaugeMetricFamily(
                f"picker_endpoint_engine_{name}", f"Last scraped engine {help_}", labels=["endpoint"]
            )
            for name, help_ in (
                ("running", "running requests"),
                ("waiting", "queued requests"),
                ("kv_usage", "KV-cache usage (0-1)"),
            )
        }
        endpoints = self._pool.endpoints()
        for endpoint in endpoints:
            address = bounded_label(endpoint.address)
            in_flight.add_metric([address], endpoint.in_flight)
            peer_in_flight.add_metric([address], endpoint.peer_in_flight)
            if endpoint.load is not None:
                engine["running"].add_metric([address], endpoint.load.running)
                engine["waiting"].add_metric([address], endpoint.load.waiting)
                engine["kv_usage"].add_metric([address], endpoint.load.kv_usage)
            for member in EndpointState:
                state.add_metric([address, member.value], 1 if endpoint.state is member else 0)
            role.add_metric([address, endpoint.role.value if endpoint.role else "invalid"], 1)
            pulls.add_metric([address], endpoint.pulls)
        ready = GaugeMetricFamily("picker_ready_endpoints", "Endpoints the picker may route new work to")
        ready.add_metric([], sum(1 for e in endpoints if e.state is EndpointState.READY))
        total = GaugeMetricFamily("picker_in_flight", "Requests in flight on all endpoints")
        total.add_metric([], sum(e.in_flight for e in endpoints))
        yield from (in_flight, peer_in_flight, state, role, pulls, ready, total, *engine.values())


class _DrainCollector(Collector):
    """Drain totals, read from the pool at scrape time (the pool counts; nothing on the request path)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        totals = self._pool.totals
        yield CounterMetricFamily("picker_drains_opened", "Drain records opened", value=totals.opened)
        closed = CounterMetricFamily("picker_drains_closed", "Drain records closed, by exit", labels=["exit"])
        for exit_state in DrainExit:
            closed.add_metric([exit_state.value], totals.closed[exit_state])
        ends = CounterMetricFamily(
            "picker_drain_request_ends", "How requests on draining endpoints ended", labels=["end"]
        )
        for end in DrainEnd:
            ends.add_metric([end.value], totals.ends[end])
        yield closed
        yield ends
        yield CounterMetricFamily(
            "picker_drain_picks_after_start",
            "New requests on an endpoint after its drain started (must stay 0)",
            value=totals.picks_after_start,
        )
        yield CounterMetricFamily(
            "picker_picks_not_ready",
            "Requests picked for, or served by, an endpoint that was not READY",
            value=totals.picks_not_ready,
        )
        yield GaugeMetricFamily(
            "picker_drains_open",
            "Endpoints with an open drain record",
            value=sum(1 for e in self._pool.endpoints() if e.drain is not None),
        )
        health = self._pool.health
        yield CounterMetricFamily(
            "picker_endpoint_failures",
            "Answers that failed before their first byte (5xx, reset, connect failure), any endpoint",
            value=health.failures,
        )
        yield CounterMetricFamily(
            "picker_endpoint_suspected",
            "Times an endpoint became suspect (failures in a row, or vLLM's drain 500): last resort only",
            value=health.suspected,
        )
        yield CounterMetricFamily(
            "picker_endpoint_suspect_cleared",
            "Suspect endpoints cleared by a good answer",
            value=health.cleared,
        )
        yield GaugeMetricFamily(
            "picker_suspect_endpoints",
            "Endpoints suspect now (never a primary pick)",
            value=len(health.suspects()),
        )


_MAX_MODELS = 32
# The longest label value exported. Model names come from request bodies and endpoint addresses
# from sources (or Envoy's upstream host): one 2 MiB name must not make every scrape of /metrics
# carry it, in every series it labels, forever. 256: a model name the door admits by default
# (requests.max_model_name_bytes) is never cut.
MAX_LABEL_CHARS = 256
TRUNCATED_MARK = "...[truncated]"


def bounded_label(value: str) -> str:
    """`value` as a label value (or in a log line): at most MAX_LABEL_CHARS, a longer one cut and marked."""
    if len(value) <= MAX_LABEL_CHARS:
        return value
    return value[: MAX_LABEL_CHARS - len(TRUNCATED_MARK)] + TRUNCATED_MARK


_MAX_CACHED_CHILDREN = 256
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)


class _Histogram(Histogram):
    """prometheus_client's Histogram, observed by bisection: its own `observe` walks the buckets one
    by one, and the request path observes several a request."""

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        self._sum.inc(amount)
        if amount == amount:  # NaN is in no bucket (as prometheus_client's own); the last is +Inf
            self._buckets[bisect_left(self._upper_bounds, amount)].inc(1)


class _Children:
    """A labelled metric's children, each looked up once (prometheus_client builds a tuple and takes a
    lock per `labels()`; a dict lookup costs a fraction of that). Bounded: label values may come from
    requests."""

    __slots__ = ("_cache", "_metric")

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._cache: dict[str, Counter | Histogram] = {}

    def __call__(self, value: str) -> Counter | Histogram:
        child = self._cache.get(value)
        if child is None:
            child = self._metric.labels(value)
            if len(self._cache) < _MAX_CACHED_CHILDREN:
                self._cache[value] = child
        return child

    def forget(self, value: str) -> None:
        """The series of `value` was removed from the metric: a later lookup makes a new child."""
        self._cache.pop(value, None)


class _CappedLabels:
    """Label values taken from requests (model names): the first N as themselves, the rest as "other".

    Each is bounded in length first, so the set of N holds nothing long either.
    """

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._seen: set[str] = set()

    def label(self, value: str) -> str:
        value = bounded_label(value)
        if value in self._seen:
            return value
        if len(self._seen) < self._cap and value:
            self._seen.add(value)
            return value
        return "other"


class FlowView(Protocol):
    @property
    def queued(self) -> int: ...

    @property
    def queued_bytes(self) -> int: ...


class _FlowCollector(Collector):
    """The admission queue, labelled by pool: an autoscaling signal (AUTOSCALING_QUERIES)."""

    def __init__(self, flow: FlowView, pool: str) -> None:
        self._flow, self._pool = flow, pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        size = GaugeMetricFamily(
            "picker_flow_queue_size", "Requests waiting in the admission queue", labels=["pool"]
        )
        size.add_metric([self._pool], self._flow.queued)
        size_bytes = GaugeMetricFamily(
            "picker_flow_queue_bytes", "Request bytes waiting in the admission queue", labels=["pool"]
        )
        size_bytes.add_metric([self._pool], self._flow.queued_bytes)
        yield from (size, size_bytes)


class _LatencyCollector(Collector):
    """affinity.latency: each replica's learned figures and its predictions' error."""

    def __init__(self, model: LatencyModel) -> None:
        self._model = model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "picker_latency_model",
            "Each replica's learned latency: ttft_base_s, prefill_s_per_ktoken, queue_s_per_request, "
            "tpot_base_s, tpot_s_per_running, and the mean absolute percentage error of its recent "
            "predictions (ttft_mape, tpot_mape)",
            labels=["endpoint", "figure"],
        )
        for address, figures in self._model.summary().items():
            for name, value in figures.items():
                if value is not None and name != "weight":
                    family.add_metric([bounded_label(address), name], float(value))
        yield family


class _DataPlanesCollector(Collector):
    """Data-plane connections by how their responses' ends reach the picker (picker/streams/ends.py)."""

    def __init__(self, planes: DataPlanes) -> None:
        self._planes = planes

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "picker_data_plane_connections",
            "Data-plane connections by who reports their responses' ends (engine: nothing does; the "
            "engines' gauges stand in, one scrape behind)",
            labels=["ends"],
        )
        counts = self._planes.counts()
        for mode in Ends:
            family.add_metric([mode.value], counts.get(mode, 0))
        yield family


# --- tenants (picker/flow/tenants.py): fair share and token budgets ---------------------------


class _TenantsCollector(Collector):
    """Per tenant, read at scrape time: the rows of picker/flow/tenant_view.py (the configured tenants
    and the busiest others by tokens each have their series, every other tenant is summed into
    `other`: a bounded label set)."""

    def __init__(self, tenants: Tenants) -> None:
        self._tenants = tenants

    def rows(self) -> dict[str, list[float]]:
        """By label: requests, tokens, held back, over budget, queued, in flight."""
        return {
            label: [t.requests, t.tokens, t.held, t.over_budget, t.queued, t.in_flight]
            for label, t in tenant_view.grouped(self._tenants).items()
        }

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        requests = CounterMetricFamily(
            "picker_tenant_requests", "Requests admitted per tenant (fairness id)", labels=["tenant"]
        )
        tokens = CounterMetricFamily(
            "picker_tenant_tokens",
            "Tokens per tenant: dispatched (reserved at dispatch from the prompt and max_tokens, settled "
            "at the end to what the engine reported)",
            labels=["tenant", "kind"],
        )
        held = CounterMetricFamily(
            "picker_tenant_held_back",
            "Times a tenant over its share of the batch slots was held back to keep the reserve",
            labels=["tenant"],
        )
        queued = GaugeMetricFamily("picker_tenant_queued", "Requests queued per tenant", labels=["tenant"])
        in_flight = GaugeMetricFamily(
            "picker_tenant_in_flight", "Requests in flight per tenant", labels=["tenant"]
        )
        for label, (n, tok, h, _over, q, f) in self.rows().items():
            requests.add_metric([label], n)
            tokens.add_metric([label, "dispatched"], tok)
            held.add_metric([label], h)
            queued.add_metric([label], q)
            in_flight.add_metric([label], f)
        yield from (requests, tokens, held, queued, in_flight)


class _BudgetsCollector(Collector):
    """Each configured token budget (picker/flow/budgets.py), read at scrape time: labels are the
    configured tenants only."""

    def __init__(self, budgets: Budgets) -> None:
        self._budgets = budgets

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        level = GaugeMetricFamily(
            "picker_tenant_budget_tokens",
            "Tokens left in the tenant's budget as this picker counts every picker's spending (below "
            "zero: owed)",
            labels=["tenant"],
        )
        refused = CounterMetricFamily(
            "picker_tenant_over_budget", "Requests refused by the tenant's token budget", labels=["tenant"]
        )
        for row in self._budgets.rows():
            level.add_metric([str(row["tenant"])], float(row["level"]))
            refused.add_metric([str(row["tenant"])], float(row["refused"]))
        yield from (level, refused)


_REJECTED_DOCS = {
    "peer_events": "Events from peers rejected whole (malformed, or naming books not theirs), by reason",
    "kv_events": "Engines' KV-event messages refused whole (not a batch, bad frames), by reason",
    "lease": "Reads of the leader Lease refused whole (malformed, out-of-range), by reason",
    "peer_move_answers": "Peers' answers to a move ask (?move_streams=true) refused whole, by reason",
    "peer_connections": "Connections on the channel between pickers refused or closed for what they did, "
    "by reason: too many not past their hello (from one source, or in all), a hello too large or late, "
    "a failed accept (out of descriptors), a frame whose MAC failed, a peer that did not prove itself",
    "peer_drain_answers": "Peers' answers to the drains query (/admin/drains?scope=pool) refused whole, "
    "by reason",
    "drain_record": "Items of the shared drain record not applied (malformed address, pod, cause or "
    "rollout), each counted once, by reason",
}


class _ReviewsCollector(Collector):
    """admin.metrics_auth: the reviews asked of the API server (picker/sources/token_review.py)."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "picker_metrics_auth_reviews",
            "Reviews of readers' bearer tokens asked of the API server (cached verdicts ask none), by "
            "review (tokenreview, subjectaccessreview) and result",
            labels=["review", "result"],
        )
        for (review, result), count in sorted(self._read().items()):
            family.add_metric([review, result], count)
        yield family


class _DeletionCostCollector(Collector):
    """kube.deletion_cost: the pod-deletion-cost annotations written (picker/sources/deletion_cost.py)."""

    def __init__(self, read: Callable[[], tuple[bool, Mapping[str, int], Mapping[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        writing, writes, skipped = self._read()
        yield GaugeMetricFamily(
            "picker_deletion_cost_writer",
            "1 while this picker writes the pool pods' pod-deletion-cost annotations (one writer per pool)",
            value=1 if writing else 0,
        )
        written = CounterMetricFamily(
            "picker_deletion_cost_writes",
            "pod-deletion-cost annotation writes (PATCH of that annotation), by result: written, gone "
            "(the pod went, or its name is another pod's now), forbidden (403: the picker may not patch "
            "pods), failed",
            labels=["result"],
        )
        for result in ("written", "gone", "forbidden", "failed"):
            written.add_metric([result], writes.get(result, 0))
        yield written
        held = CounterMetricFamily(
            "picker_deletion_cost_skipped",
            "Annotation changes held back at a step, by why: interval (the pod was written less than "
            "kube.deletion_cost_interval_s ago), bound (scale_down.max_writes reached), standby (steps "
            "while another picker writes), forbidden (steps held back after a patch was refused)",
            labels=["reason"],
        )
        for reason in ("interval", "bound", "standby", "forbidden"):
            held.add_metric([reason], skipped.get(reason, 0))
        yield held


class _PoolStatusCollector(Collector):
    """kube.pool_status: the InferencePool's Ready condition and events (picker/sources/pool_status/)."""

    def __init__(self, read: Callable[[], tuple[bool, Mapping[str, int], Mapping[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        writing, writes, events = self._read()
        yield GaugeMetricFamily(
            "picker_pool_status_writer",
            "1 while this picker writes the InferencePool's status and events (one writer per pool)",
            value=1 if writing else 0,
        )
        written = CounterMetricFamily(
            "picker_pool_status_writes",
            "Looks at the InferencePool's Ready condition that read it, by result: written, unchanged "
            "(the entry already said it), conflict (written meanwhile: read again), failed",
            labels=["result"],
        )
        for result in ("written", "unchanged", "conflict", "failed"):
            written.add_metric([result], writes.get(result, 0))
        yield written
        made = CounterMetricFamily(
            "picker_pool_status_events",
            "Events about the pool (changes of state, drains, rollbacks), by result: created, failed",
            labels=["result"],
        )
        for result in ("created", "failed"):
            made.add_metric([result], events.get(result, 0))
        yield made


class _RejectedCollector(Collector):
    """Inputs from outside the process rejected whole, by reason (read at scrape time)."""

    def __init__(self, name: str, doc: str, read: Callable[[], Mapping[str, int]]) -> None:
        self._name, self._doc, self._read = name, doc, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=["reason"])
        for reason, count in sorted(self._read().items()):
            family.add_metric([reason], count)
        yield family


# The pool's autoscaling signals: each family, what it is, and the PromQL an HPA (prometheus-adapter)
# or KEDA reads it with (`$POOL`: the pool label, PickerConfig.pool_label). Each picker of a pool
# sees every picker's streams (shared books) but only its own queue: max() over the pickers where the
# figure holds the streams, sum() for the queue (docs, "Autoscaling signals"; config/k8s/autoscaling).
AUTOSCALING_QUERIES: dict[str, tuple[str, str]] = {
    "picker_pool_ready_capacity": (
        "Slots of the READY endpoints (engine_slots, or learned): what new traffic can use; absent "
        "while a ready endpoint's slot count is unknown",
        'max(picker_pool_ready_capacity{pool="$POOL"})',
    ),
    "picker_pool_demand": (
        "Requests in flight on the pool's endpoints (every picker's, draining ones too: their traffic "
        "goes on) plus this picker's queue",
        'max(picker_pool_demand{pool="$POOL"})',
    ),
    "picker_pool_saturation": (
        "Demand over ready capacity (1: every ready slot busy; with no ready slot, the demand "
        "itself); absent while a slot count is unknown",
        'max(picker_pool_saturation{pool="$POOL"})',
    ),
    "picker_flow_queue_size": (
        "Requests waiting in the admission queue",
        'sum(picker_flow_queue_size{pool="$POOL"})',
    ),
    "picker_pool_predicted_wait_seconds": (
        "A request arriving now: the queue and the requests on READY endpoints beyond the ready "
        "slots (the queue where slots are unknown), plus one, over the pool's completions per second "
        "(autoscaling.rate_window_s); 0 with a free ready slot; absent when requests wait and none "
        "ended (never +Inf)",
        'max(picker_pool_predicted_wait_seconds{pool="$POOL"})',
    ),
    "picker_pool_removable_replicas": (
        "Ready replicas a scale-down could take now, the capacity guard allowing each drain "
        "(demand x (1 + admin.drain_headroom) stays ready); absent while a slot count is unknown",
        'min(picker_pool_removable_replicas{pool="$POOL"})',
    ),
}


class _CapacityCollector(Collector):
    """The pool's signals (picker/scheduling/signals.py), computed when the page is read."""

    def __init__(self, read: Callable[[], PoolFigures], pool: str) -> None:
        self._read, self._pool = read, pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        figures = self._read()
        for name, value in (
            ("picker_pool_ready_capacity", figures.ready_capacity),
            ("picker_pool_demand", figures.demand),
            ("picker_pool_saturation", figures.saturation),
            ("picker_pool_predicted_wait_seconds", figures.predicted_wait_s),
            ("picker_pool_removable_replicas", figures.removable),
        ):
            family = GaugeMetricFamily(name, AUTOSCALING_QUERIES[name][0], labels=["pool"])
            if value is not None and math.isfinite(value):  # unknown or unbounded: no sample
                family.add_metric([self._pool], value)
            yield family


class RolloutView(Protocol):
    """What the canary (picker/rollout's Canary) shows the metrics page."""

    phase: str
    weight: int
    rollbacks: int
    totals: dict[str, int]


class _RolloutCollector(Collector):
    def __init__(self, canary: RolloutView) -> None:
        self._canary = canary

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        canary = self._canary
        yield GaugeMetricFamily(
            "picker_rollout_weight", "The candidate group's share of new requests (%)", value=canary.weight
        )
        phase = GaugeMetricFamily(
            "picker_rollout_phase", "1 for the canary's current phase", labels=["phase"]
        )
        for name in ("progressing", "paused", "promoted", "rolled-back"):
            phase.add_metric([name], 1.0 if canary.phase == name else 0.0)
        yield phase
        yield CounterMetricFamily(
            "picker_rollout_rollbacks", "Rollbacks (a failed gate, or abort)", value=canary.rollbacks
        )
        routed = CounterMetricFamily(
            "picker_rollout_routed", "Requests routed to each canary group", labels=["group"]
        )
        for group, count in sorted(canary.totals.items()):
            routed.add_metric([group], count)
        yield routed


class PeersView(Protocol):
    """What the channel between pickers counts (picker/peers/books.py's Peering)."""

    peers: tuple[str, ...]
    connected: set[str]
    forwarded: int
    applied: int
    unknown: int
    observers: int

    @property
    def dropped(self) -> int: ...

    @property
    def orphans(self) -> int: ...

    @property
    def superseded_total(self) -> int: ...

    @property
    def known_connections(self) -> int: ...


class _PeersCollector(Collector):
    def __init__(self, peers: PeersView) -> None:
        self._peers = peers

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        p = self._peers
        yield GaugeMetricFamily("picker_peers", "Other pickers in peers.members", value=len(p.peers))
        yield GaugeMetricFamily(
            "picker_peers_connected", "Peers this picker's channel currently reaches", value=len(p.connected)
        )
        yield GaugeMetricFamily(
            "picker_peer_orphans",
            "Requests of a peer whose channel broke, still counted on their endpoints until seen to end",
            value=p.orphans,
        )
        events = CounterMetricFamily(
            "picker_peer_events",
            "Events about single requests: forwarded to their routing picker, applied here from a peer, "
            "unknown (the request had already ended here), dropped (a peer stayed away too long)",
            labels=["kind"],
        )
        for kind, value in (
            ("forwarded", p.forwarded),
            ("applied", p.applied),
            ("unknown", p.unknown),
            ("dropped", p.dropped),
        ):
            events.add_metric([kind], value)
        yield events
        yield CounterMetricFamily(
            "picker_peer_observers",
            "Observer streams for requests another picker routed, tracked here for it",
            value=p.observers,
        )
        yield CounterMetricFamily(
            "picker_peer_superseded",
            "Requests a newer request on the same HTTP/1.x client connection showed had ended, before "
            "their end reached this picker (no longer counted in their endpoint's load from then)",
            value=p.superseded_total,
        )
        yield GaugeMetricFamily(
            "picker_peer_client_connections",
            "Requests in flight, this picker's and its peers', whose HTTP/1.x client connection it knows",
            value=p.known_connections,
        )


class Metrics:
    """The picker's metrics; construct once per picker and pass it down."""

    def __init__(self, registry: CollectorRegistry | None = None, *, pool: str) -> None:
        self.registry = registry or CollectorRegistry()
        self.pool = pool  # the `pool` label of the per-pool gauges (PickerConfig.pool_label)
        r = self.registry
        self._requests = Counter("picker_requests", "Requests by admission outcome", ["outcome"], registry=r)
        self._leader: Gauge | None = None  # leader.enabled only (set_leader)
        self._leading = False
        self._ends = Counter("picker_request_ends", "Requests by end reason", ["reason"], registry=r)
        self._picks = Counter("picker_picks", "Primary picks per endpoint", ["endpoint"], registry=r)
        self._picks_without_metrics = Counter(
            "picker_picks_without_metrics",
            "Picks made by in-flight counts because no endpoint had load data (every scrape failed)",
            registry=r,
        )
        self._stream_resumes = Counter(
            "picker_stream_resumes",
            "Streams cut after their first token and continued on another replica (picker proxy, "
            "streams.resume), by why; no-replica / not-resumable / failed / limit / too-long / "
            "reasoning-output / nothing-left: cut after all; stall-kept: stalled, nowhere to move",
            ["reason"],
            registry=r,
        )
        self._admin_refused = Counter(
            "picker_admin_browser_refused",
            "State-changing admin requests refused as a web page's (picker/admin/browser.py), by why",
            ["reason"],
            registry=r,
        )
        self._fallback_served = Counter(
            "picker_fallback_served",
            "Requests Envoy served from a listed fallback, not the primary",
            registry=r,
        )
        self._pick_seconds = _Histogram(
            "picker_pick_duration_seconds",
            "Time to admit and pick one request",
            buckets=_PICK_BUCKETS,
            registry=r,
        )
        self._books_gap = _Histogram(
            "picker_books_gap_requests",
            "At each scrape, how far the pickers' count on an endpoint was from its engine's running + "
            "waiting (less what was on its way): about 0 where every end is seen",
            buckets=(0.0, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0),
            registry=r,
        )
        self._queue_wait = _Histogram(
            "picker_flow_wait_seconds",
            "Time spent in the admission queue, by outcome",
            ["outcome"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._models = _CappedLabels(_MAX_MODELS)
        self._itl_children: dict[str, Histogram] = {}  # by the request's model name (not yet capped)
        self._ttft = _Histogram(
            "picker_time_to_first_token_seconds",
            "Admission to first response byte, by model",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self._itl = _Histogram(
            "picker_inter_token_latency_seconds",
            "Gap between stream chunks, by model",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self._truncations = Counter(
            "picker_endpoint_truncations",
            "Streams cut after their first byte, per endpoint",
            ["endpoint"],
            registry=r,
        )
        self._stalls = Counter(
            "picker_endpoint_stalls", "Streams that went silent, per endpoint", ["endpoint"], registry=r
        )
        self._retries = Counter(
            "picker_upstream_retries",
            "Upstream attempts Envoy retried before the first byte, per serving endpoint",
            ["endpoint"],
            registry=r,
        )
        self._scrape_failures = Counter(
            "picker_scrape_failures", "Failed /metrics scrapes per endpoint", ["endpoint", "kind"], registry=r
        )
        self._placements = Counter(
            "picker_affinity_picks",
            "Cache-aware picks by how the primary was chosen (session, lora, sticky prefix, or score)",
            ["how"],
            registry=r,
        )
        # prefill / decode pools (picker/request/pairing.py)
        self._pd_picks = Counter(
            "picker_pd_picks",
            "Picks in a prefill / decode pool, by how: pair (a prefill replica named), short (the "
            "destination computes the prompt: too little of it uncached), no-prefill (no prefill "
            "replica of its revision ready), unpaired (no revision had both roles ready)",
            ["how"],
            registry=r,
        )
        self._pd_pulls_abandoned = Counter(
            "picker_pd_pulls_abandoned",
            "Prefill hand-offs a draining replica gave up at drain.kv_pull_timeout_s (the decode side "
            "recomputes the prompt)",
            registry=r,
        )
        # picker proxy's own prefill / decode steps (picker/proxy/pd_steps.py)
        self._pd_recomputes = Counter(
            "picker_pd_recomputes",
            "Paired requests whose decode replica computed the prompt itself (sent again without "
            "kv_transfer_params, before any byte reached the client), by why: prefill-unreachable, "
            "prefill-status (not 2xx), prefill-timeout, prefill-bad-params (an answer without usable "
            "kv_transfer_params), pull-failed (the decode failed before its first token)",
            ["why"],
            registry=r,
        )
        self._latency_waits = Counter(
            "picker_latency_waits",
            "Requests held in the picker for a busy replica predicted to serve them sooner than any "
            "with room (affinity.latency)",
            registry=r,
        )
        self._latency_engaged = Gauge(
            "picker_latency_engaged",
            "1 while the pick routes by predicted latency (affinity.latency on, or auto with a pool that "
            "is not uniform), else 0; picker_latency_spread: the spread auto judged by",
            registry=r,
        )
        self._latency_spread = Gauge(
            "picker_latency_spread",
            "affinity.latency auto: the slowest measured replica's predicted time for the same request over "
            "the median replica's (the quicker of two), at the last check (0: fewer than two measured)",
            registry=r,
        )
        self._placed_cached = _Histogram(
            "picker_affinity_cached_share",
            "Share of the prompt the primary was known to hold, per cache-aware pick",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0),
            registry=r,
        )
        self._latency_error = _Histogram(
            "picker_latency_prediction_error",
            "affinity.latency: |predicted - measured| / measured of the primary's TTFT or time per output "
            "token, per request (the predictions' per-replica error: picker_latency_model)",
            ["kind"],
            buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self._slo = Counter(
            "picker_slo_requests",
            "Requests with a latency objective (SLO headers), by objective and whether it was met, "
            "missed, or the request refused (sheddable, no replica predicted to meet it)",
            ["objective", "result"],
            registry=r,
        )
        self._prefix_predicted = Counter(
            "picker_prefix_predicted_tokens",
            "Prompt tokens the approximate index expected the serving engine to hold",
            registry=r,
        )
        self._prefix_engine_cached = Counter(
            "picker_prefix_engine_cached_tokens",
            "Prompt tokens the serving engine reported cached (usage.prompt_tokens_details)",
            registry=r,
        )
        for how in ("session", "lora", "sticky", "score"):
            self._placements.labels(how)
        self._access_log_failures = Counter(
            "picker_access_log_entry_failures",
            "Envoy access-log entries the picker could not handle (logged and skipped)",
            registry=r,
        )
        self._unmatched = Counter(
            "picker_observer_unmatched", "Observer streams for requests this picker did not route", registry=r
        )
        self._drain_seconds = _Histogram(
            "picker_drain_duration_seconds",
            "From a drain's start to its exit, by exit",
            ["exit"],
            buckets=_DRAIN_BUCKETS,
            registry=r,
        )
        self._drain_to_zero = _Histogram(
            "picker_drain_time_to_zero_seconds",
            "From a drain's start until its last in-flight request ended",
            buckets=_DRAIN_BUCKETS,
            registry=r,
        )
        self._source_events = Counter(
            "picker_endpoint_source_events",
            "Endpoint source activity: lists, watch ends and failures by kind, file loads and rejections",
            ["source", "event"],
            registry=r,
        )
        for outcome in Outcome:
            self._requests.labels(outcome.value)
        for reason in EndReason:
            self._ends.labels(reason.value)
        # the children the request path counts into, each looked up once (_Children)
        self._requests_by, self._queue_wait_by = _Children(self._requests), _Children(self._queue_wait)
        self._ends_by = _Children(self._ends)
        self._ttft_by, self._itl_by = _Children(self._ttft), _Children(self._itl)
        self._placements_by = _Children(self._placements)
        self._picks_by, self._latency_error_by = _Children(self._picks), _Children(self._latency_error)
        self._reference_names(r)

    def _reference_names(self, r: CollectorRegistry) -> None:
        """The reference picker's names (picker/observability/reference/): its new facts recorded
        once under its names, the picker's existing recordings shown again at scrape time."""
        self.reference = ReferenceSeries(r, self._models)
        self._reference_views = ReferenceViews(
            self.pool,
            self._models,
            ttft=self._ttft,
            pick=self._pick_seconds,
            queue_wait=self._queue_wait,
            output_tokens=self.reference.output_tokens,
            bounded=bounded_label,
        )
        r.register(self._reference_views)

    def register_running(self, read: Callable[[], Iterable[str]]) -> None:
        """`read()` gives the model of each request in flight (inference_objective_running_requests)."""
        self._reference_views.running = read

    def register_load_policy(self, policy: LoadPolicy, clock: Callable[[], float]) -> None:
        """The thresholds the pick calls an engine saturated by, and the clock of its load samples:
        the reference's pool saturation is computed from them at scrape time."""
        self._reference_views.policy, self._reference_views.clock = policy, clock

    def count_request_end(self, reason: EndReason, record: RequestRecord, now: float, tokens: int) -> None:
        """A dispatched request ended at `now` having streamed `tokens` (`count_end`), and its duration,
        sizes, prompt tokens and time per output token (first token to end over the later tokens)."""
        self.count_end(reason, record.endpoint, record.model, tokens)
        tracker = record.tracker
        first = tracker.first_byte_at if tracker is not None else None
        self.reference.ended(
            record.model,
            duration_s=now - record.admitted_at,
            request_bytes=record.body_bytes,
            response_bytes=tracker.bytes if tracker is not None else 0,
            prompt_tokens=tracker.usage_prompt_tokens if tracker is not None else None,
            tpot_s=(now - first) / (tokens - 1) if first is not None and tokens > 1 else None,
        )

    def count_refusal(self, model: str, outcome: Outcome) -> None:
        """A request the picker answered itself (inference_objective_request_error_total)."""
        self.reference.refused(model, outcome)

    def register_latency(self, model: LatencyModel) -> None:
        self.registry.register(_LatencyCollector(model))

    def observe_latency_prediction(
        self, endpoint: str, kind: str, predicted: float | None, measured: float, slo: Slo | None
    ) -> None:
        """One checked prediction (`kind` ttft or tpot), and the request's objective for it, if any."""
        if predicted is not None and measured > 0:
            self._latency_error_by(kind).observe(abs(predicted - measured) / measured)
        bound = None if slo is None else slo.ttft_s if kind == "ttft" else slo.tpot_s
        if bound is not None:
            self._slo.labels(kind, "met" if measured <= bound else "missed").inc()

    def count_slo(self, slo: Slo, result: str) -> None:
        for objective, bound in (("ttft", slo.ttft_s), ("tpot", slo.tpot_s)):
            if bound is not None:
                self._slo.labels(objective, result).inc()

    def register_pool(self, pool: Pool) -> None:
        self.registry.register(_PoolCollector(pool))
        self._reference_views.pool = pool
        self.registry.register(_DrainCollector(pool))
        pool.on_drain_closed(self.observe_drain)
        pool.on_forget(self.forget_endpoint)

    def forget_endpoint(self, address: str) -> None:
        """Drop an endpoint's labelled series once the pool forgets it: with pod churn (every
        rollout brings new addresses) they would otherwise grow the page without bound."""
        label = {"endpoint": bounded_label(address)}
        self._picks_by.forget(label["endpoint"])  # dropped with its series below
        for family in (self._picks, self._truncations, self._stalls, self._retries, self._scrape_failures):
            family.remove_by_labels(label)

    def observe_drain(self, record: DrainRecord) -> None:
        """A drain record closed: its duration and time to zero in flight."""
        if record.exit is not None and record.closed_at is not None:
            self._drain_seconds.labels(record.exit.value).observe(record.closed_at - record.started_at)
        if record.time_to_zero_s is not None:
            self._drain_to_zero.observe(record.time_to_zero_s)

    def count_source_event(self, source: str, event: str) -> None:
        """`source` and `event` come from code (closed sets in picker/sources), never from requests."""
        self._source_events.labels(bounded_label(source), bounded_label(event)).inc()

    def books_checked(self, endpoint: Endpoint) -> None:
        """A scrape just read `endpoint`'s gauges: how far the books were from them."""
        self._books_gap.observe(abs(books_gap(endpoint)))

    def count_admission(self, outcome: Outcome, waited_s: float) -> None:
        """Every request's admission outcome, with the time it spent queued (0 when not queued)."""
        self._requests_by(outcome.value).inc()
        self._queue_wait_by(outcome.value).observe(waited_s)

    def register_peers(self, peers: PeersView) -> None:
        self.registry.register(_PeersCollector(peers))

    def register_capacity(self, read: Callable[[], PoolFigures]) -> None:
        """`read()` gives the pool's signals at each scrape (the capacity guard's figures)."""
        self.registry.register(_CapacityCollector(read, self.pool))

    def register_rollout(self, canary: RolloutView) -> None:
        self.registry.register(_RolloutCollector(canary))

    def register_flow(self, flow: FlowView) -> None:
        self.registry.register(_FlowCollector(flow, self.pool))
        self._reference_views.flow = flow

    def register_rejections(self, source: str, read: Callable[[], Mapping[str, int]]) -> None:
        """Inputs from outside refused whole, by reason, read at scrape time: `peer_events` (the
        channel between pickers) or `kv_events` (the engines' KV events)."""
        self.registry.register(_RejectedCollector(f"picker_{source}_rejected", _REJECTED_DOCS[source], read))

    def register_deletion_cost(
        self, read: Callable[[], tuple[bool, Mapping[str, int], Mapping[str, int]]]
    ) -> None:
        """kube.deletion_cost: `read()` gives (writing now, writes by result, changes held back by why)."""
        self.registry.register(_DeletionCostCollector(read))

    def register_pool_status(
        self, read: Callable[[], tuple[bool, Mapping[str, int], Mapping[str, int]]]
    ) -> None:
        """kube.pool_status: `read()` gives (writing now, condition writes by result, events by result)."""
        self.registry.register(_PoolStatusCollector(read))

    def register_metrics_auth(self, read: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self.registry.register(_ReviewsCollector(read))

    def register_data_planes(self, planes: DataPlanes) -> None:
        self.registry.register(_DataPlanesCollector(planes))

    def register_budgets(self, budgets: Budgets) -> None:
        """Token budgets configured: each one's level and refusals, read at scrape time."""
        self.registry.register(_BudgetsCollector(budgets))

    def register_tenants(self, tenants: Tenants) -> None:
        """Fair share on: the tenants' books, read at scrape time (bounded labels); the reference's
        queue size by fairness_id from the same rows."""
        collector = _TenantsCollector(tenants)
        self.registry.register(collector)
        self._reference_views.queued_by_tenant = lambda: {k: row[4] for k, row in collector.rows().items()}

    def count_end(
        self, reason: EndReason, endpoint: str | None = None, model: str = "", tokens: int = 0
    ) -> None:
        """A request's one end reason, and what it produced."""
        self._ends_by(reason.value).inc()
        if tokens:
            self.reference.produced(model, tokens)
        if endpoint and reason is EndReason.UPSTREAM_TRUNCATED:
            self._truncations.labels(bounded_label(endpoint)).inc()

    def observe_ttft(self, model: str, seconds: float) -> None:
        self._ttft_by(self._models.label(model)).observe(seconds)

    def observe_itl(self, model: str, seconds: float) -> None:
        """Once per chunk of every stream: the labelled child is looked up once per model name."""
        child = self._itl_children.get(model)
        if child is None:
            child = self._itl_by(self._models.label(model))
            if len(self._itl_children) < 2 * _MAX_MODELS:  # names come from requests: bounded
                self._itl_children[model] = child
        child.observe(seconds)

    def count_stall(self, endpoint: str) -> None:
        self._stalls.labels(bounded_label(endpoint)).inc()

    def count_upstream_retry(self, endpoint: str, retries: int) -> None:
        self._retries.labels(bounded_label(endpoint)).inc(retries)

    def count_pick(self, endpoint: str, seconds: float, model: str = "", priority: int = 0) -> None:
        self._picks_by(bounded_label(endpoint)).inc()  # forget_endpoint drops it with its series
        self._pick_seconds.observe(seconds)
        self.reference.picked(model, priority)

    def set_leader(self, leading: bool) -> None:
        """leader.enabled: whether this replica holds the Lease (registered on first use)."""
        if self._leader is None:
            r = self.registry
            self._leader = Gauge("picker_leader", "1 while this replica holds the leader Lease", registry=r)
            self._leader_changes = Counter(
                "picker_leader_changes", "Times this replica became or stopped being the leader", registry=r
            )
        elif self._leading != leading:
            self._leader_changes.inc()
        self._leading = leading
        self._leader.set(1 if leading else 0)

    def count_scrape_failure(self, endpoint: str, kind: str) -> None:
        self._scrape_failures.labels(bounded_label(endpoint), bounded_label(kind)).inc()

    def count_resume(self, reason: str) -> None:
        self._stream_resumes.labels(bounded_label(reason)).inc()

    def count_admin_refused(self, reason: str) -> None:
        self._admin_refused.labels(bounded_label(reason)).inc()

    def count_fallback_served(self) -> None:
        self._fallback_served.inc()

    def count_pick_without_metrics(self) -> None:
        self._picks_without_metrics.inc()

    def count_pd_pick(self, how: str) -> None:
        self._pd_picks.labels(how).inc()

    def count_pd_pull_abandoned(self) -> None:
        self._pd_pulls_abandoned.inc()

    def count_pd_recompute(self, why: str) -> None:
        self._pd_recomputes.labels(why).inc()

    def count_placement(self, how: str, cached: float) -> None:
        """A cache-aware pick: how it was chosen, and the share of the prompt it was known to hold."""
        self._placements_by(how).inc()
        self._placed_cached.observe(cached)

    def set_latency_engaged(self, engaged: bool, spread: float | None = None) -> None:
        """Whether the pick routes by predicted latency now, and the spread it was judged by."""
        self._latency_engaged.set(1 if engaged else 0)
        self._latency_spread.set(spread or 0.0)

    def count_latency_wait(self) -> None:
        """A request chose to wait for a busy replica predicted quicker (counted once per request)."""
        self._latency_waits.inc()

    def count_prefix_feedback(self, predicted_tokens: int, engine_cached_tokens: int) -> None:
        """The engine's report of a prompt's cached tokens beside what the picker's index predicted."""
        self._prefix_predicted.inc(predicted_tokens)
        self._prefix_engine_cached.inc(engine_cached_tokens)

    def count_access_log_failure(self) -> None:
        self._access_log_failures.inc()

    def count_unmatched_observer(self) -> None:
        self._unmatched.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class JsonLines(logging.Formatter):
    """One JSON object per line (`--zap-encoder json`, as the reference picker logs for collectors)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            line["error"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(level: str, log_format: str = "text") -> None:
    """key=value lines (or JSON objects) on stderr; never prompt or completion text."""
    handler = logging.StreamHandler()
    if log_format == "json":
        formatter: logging.Formatter = JsonLines()
        formatter.converter = time.gmtime
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
    handler.setFormatter(formatter)
    logging.basicConfig(level=level, handlers=[handler])
    # httpx2 (lightkube's client) logs every request at INFO: each watch reconnect would add a line.
    logging.getLogger("httpx2").setLevel(max(logging.WARNING, logging.getLevelName(level)))
