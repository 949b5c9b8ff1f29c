"""Every Prometheus metric the picker exports, and the small typed helpers call sites use.

One registry per picker instance (tests run several in one process). Per-endpoint gauges are read
from the pool at scrape time, so the request path never touches a gauge.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from picker.contract import Outcome
from picker.pool import EndpointState, Pool
from picker.streams import EndReason

# `_created` samples double every counter's page size and nobody reads them.
disable_created_metrics()

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_PICK_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)


class _PoolCollector(Collector):
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "picker_endpoint_in_flight",
            "Requests the picker has in flight on each endpoint",
            labels=["endpoint"],
        )
        state = GaugeMetricFamily(
            "picker_endpoint_state", "1 for the endpoint's current state", labels=["endpoint", "state"]
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
            in_flight.add_metric([endpoint.address], endpoint.in_flight)
            if endpoint.load is not None:
                engine["running"].add_metric([endpoint.address], endpoint.load.running)
                engine["waiting"].add_metric([endpoint.address], endpoint.load.waiting)
                engine["kv_usage"].add_metric([endpoint.address], endpoint.load.kv_usage)
            for member in EndpointState:
                state.add_metric([endpoint.address, member.value], 1 if endpoint.state is member else 0)
        ready = GaugeMetricFamily("picker_ready_endpoints", "Endpoints the picker may route new work to")
        ready.add_metric([], sum(1 for e in endpoints if e.state is EndpointState.READY))
        total = GaugeMetricFamily("picker_in_flight", "Requests in flight on all endpoints")
        total.add_metric([], sum(e.in_flight for e in endpoints))
        yield from (in_flight, state, ready, total, *engine.values())


class FlowView(Protocol):
    @property
    def queued(self) -> int: ...

    @property
    def queued_bytes(self) -> int: ...


class _FlowCollector(Collector):
    def __init__(self, flow: FlowView) -> None:
        self._flow = flow

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "picker_flow_queue_size", "Requests waiting in the admission queue", value=self._flow.queued
        )
        yield GaugeMetricFamily(
            "picker_flow_queue_bytes",
            "Request bytes waiting in the admission queue",
            value=self._flow.queued_bytes,
        )


class Metrics:
    """The picker's metrics; construct once per picker and pass it down."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._requests = Counter("picker_requests", "Requests by admission outcome", ["outcome"], registry=r)
        self._ends = Counter("picker_request_ends", "Requests by end reason", ["reason"], registry=r)
        self._picks = Counter("picker_picks", "Primary picks per endpoint", ["endpoint"], registry=r)
        self._fallback_served = Counter(
            "picker_fallback_served",
            "Requests Envoy served from a listed fallback, not the primary",
            registry=r,
        )
        self._pick_seconds = Histogram(
            "picker_pick_duration_seconds",
            "Time to admit and pick one request",
            buckets=_PICK_BUCKETS,
            registry=r,
        )
        self._queue_wait = Histogram(
            "picker_flow_wait_seconds",
            "Time spent in the admission queue, by outcome",
            ["outcome"],
            buckets=_WAIT_BUCKETS,
            registry=r,
        )
        self._scrape_failures = Counter(
            "picker_scrape_failures", "Failed /metrics scrapes per endpoint", ["endpoint", "kind"], registry=r
        )
        self._unmatched = Counter(
            "picker_observer_unmatched", "Observer streams for requests this picker did not route", registry=r
        )
        for outcome in Outcome:
            self._requests.labels(outcome.value)
        for reason in EndReason:
            self._ends.labels(reason.value)

    def register_pool(self, pool: Pool) -> None:
        self.registry.register(_PoolCollector(pool))

    def count_admission(self, outcome: Outcome, waited_s: float) -> None:
        """Every request's admission outcome, with the time it spent queued (0 when not queued)."""
        self._requests.labels(outcome.value).inc()
        self._queue_wait.labels(outcome.value).observe(waited_s)

    def register_flow(self, flow: FlowView) -> None:
        self.registry.register(_FlowCollector(flow))

    def count_end(self, reason: EndReason) -> None:
        self._ends.labels(reason.value).inc()

    def count_pick(self, endpoint: str, seconds: float) -> None:
        self._picks.labels(endpoint).inc()
        self._pick_seconds.observe(seconds)

    def count_scrape_failure(self, endpoint: str, kind: str) -> None:
        self._scrape_failures.labels(endpoint, kind).inc()

    def count_fallback_served(self) -> None:
        self._fallback_served.inc()

    def count_unmatched_observer(self) -> None:
        self._unmatched.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def configure_logging(level: str) -> None:
    """key=value lines on stderr; never prompt or completion text."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
