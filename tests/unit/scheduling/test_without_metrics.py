"""Model servers without vLLM's metrics: when no candidate has load data and all have failed their
scrapes, the picker should pick by its own in-flight counts rather than queue everything."""

from __future__ import annotations

import random

from picker.pool import Endpoint, EndpointState
from picker.pool.scrapes import record_failure, record_sample
from picker.scheduling import LoadPolicy, pick, without_metrics

POLICY = LoadPolicy(staleness_s=2.0)


def endpoint(address: str, in_flight: int = 0) -> Endpoint:
    return Endpoint(address, EndpointState.READY, 0.0, in_flight=in_flight)


def test_every_scrape_failed_and_no_load_data_anywhere() -> None:
    a, b = endpoint("a:1", in_flight=3), endpoint("b:1", in_flight=1)
    assert not without_metrics([a, b], POLICY)  # before the first scrape: wait for it
    record_failure(a)
    assert not without_metrics([a, b], POLICY)  # b has not failed yet
    record_failure(b)
    assert without_metrics([a, b], POLICY)
    assert pick([a, b], 2, random.Random(0), 0.0, POLICY) == []  # what the metrics policy would do
    fallback = LoadPolicy(use_metrics=False)
    assert pick([a, b], 2, random.Random(0), 0.0, fallback) == ["b:1", "a:1"]  # least in flight first


def test_one_endpoint_with_load_data_keeps_the_metrics_policy() -> None:
    a, b = endpoint("a:1"), endpoint("b:1")
    record_failure(a)
    record_sample(b, running=0, waiting=0, kv_usage=0.0, now=0.0)
    assert not without_metrics([a, b], POLICY)
    assert pick([a, b], 1, random.Random(0), 0.0, POLICY) == ["b:1"]


def test_not_when_scraping_is_off_or_there_is_no_candidate() -> None:
    a = endpoint("a:1")
    record_failure(a)
    assert not without_metrics([a], LoadPolicy(use_metrics=False))
    assert not without_metrics([], POLICY)
