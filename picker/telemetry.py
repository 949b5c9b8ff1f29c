"""Every Prometheus metric the picker exports, and the small typed helpers call sites use.

One registry per picker instance (tests run several in one process). Per-endpoint gauges are read
from the pool at scrape time, so the request path never touches a gauge.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from picker.contract import Outcome
from picker.pool import EndpointState, Pool
from picker.streams import EndReason

# `_created` samples double every counter's page size and nobody reads them.
disable_created_metrics()

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
        endpoints = self._pool.endpoints()
        for endpoint in endpoints:
            in_flight.add_metric([endpoint.address], endpoint.in_flight)
            for member in EndpointState:
                state.add_metric([endpoint.address, member.value], 1 if endpoint.state is member else 0)
        ready = GaugeMetricFamily("picker_ready_endpoints", "Endpoints the picker may route new work to")
        ready.add_metric([], sum(1 for e in endpoints if e.state is EndpointState.READY))
        total = GaugeMetricFamily("picker_in_flight", "Requests in flight on all endpoints")
        total.add_metric([], sum(e.in_flight for e in endpoints))
        yield from (in_flight, state, ready, total)


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
        self._unmatched = Counter(
            "picker_observer_unmatched", "Observer streams for requests this picker did not route", registry=r
        )
        for outcome in Outcome:
            self._requests.labels(outcome.value)
        for reason in EndReason:
            self._ends.labels(reason.value)

    def register_pool(self, pool: Pool) -> None:
        self.registry.register(_PoolCollector(pool))

    def count_outcome(self, outcome: Outcome) -> None:
        self._requests.labels(outcome.value).inc()

    def count_end(self, reason: EndReason) -> None:
        self._ends.labels(reason.value).inc()

    def count_pick(self, endpoint: str, seconds: float) -> None:
        self._picks.labels(endpoint).inc()
        self._pick_seconds.observe(seconds)

    def count_fallback_served(self) -> None:
        self._fallback_served.inc()

    def count_unmatched_observer(self) -> None:
        self._unmatched.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def configure_logging(level: str) -> None:
    """key=value lines on stderr; never prompt or completion text."""
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
