"""Per-endpoint series follow the pool: an endpoint forgotten (GONE, last request ended) leaves /metrics,
so pod churn does not grow the page for ever (issue 21)."""

from __future__ import annotations

from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.streams import EndReason

REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)


def series_for(metrics: Metrics, address: str) -> list[str]:
    page = metrics.exposition().decode()
    return [line for line in page.splitlines() if f'endpoint="{address}"' in line]


def test_a_forgotten_endpoints_series_are_removed_and_the_rest_stay() -> None:
    pool, metrics = Pool(), Metrics(pool="default")
    metrics.register_pool(pool)
    path = RequestPath(pool, metrics, fallback_count=0, schedule=lambda delay, fn: lambda: None)
    for generation in range(50):  # a rollout replacing the pod each time
        address = f"10.0.{generation}.1:8000"
        pool.apply(ready=[address, "10.9.9.9:8000"])
        for _ in range(2):
            record = path.admit(REQUEST).payload
            path.response_started(record, 200, record.picked[0], streaming=True)
            path.finish(record, EndReason.UPSTREAM_TRUNCATED)
        metrics.count_scrape_failure(address, "timeout")
        metrics.count_upstream_retry(address, 1)
        metrics.count_stall(address)
        assert series_for(metrics, address)
    pool.apply(ready=["10.9.9.9:8000"])
    for generation in range(50):
        assert series_for(metrics, f"10.0.{generation}.1:8000") == []
    assert any(line.startswith("picker_picks_total") for line in series_for(metrics, "10.9.9.9:8000"))


def test_an_endpoint_still_finishing_keeps_its_series_until_its_last_request_ends() -> None:
    pool, metrics = Pool(), Metrics(pool="default")
    metrics.register_pool(pool)
    path = RequestPath(pool, metrics, fallback_count=0, schedule=lambda delay, fn: lambda: None)
    pool.apply(ready=["a:1"])
    record = path.admit(REQUEST).payload
    pool.apply(ready=[])  # removed while its stream runs: GONE, not forgotten
    assert series_for(metrics, "a:1")
    path.finish(record, EndReason.UPSTREAM_TRUNCATED)
    assert series_for(metrics, "a:1") == []


def test_an_endpoint_forgotten_then_back_is_counted_again() -> None:
    """An address the pool forgot and sees again (a reused pod IP) shows its picks anew: the request
    path's children are not kept past `forget_endpoint`."""
    metrics = Metrics(pool="default")
    metrics.count_pick("10.0.0.9:8000", 0.001)
    metrics.forget_endpoint("10.0.0.9:8000")
    metrics.count_pick("10.0.0.9:8000", 0.001)
    assert metrics.registry.get_sample_value("picker_picks_total", {"endpoint": "10.0.0.9:8000"}) == 1.0


def test_a_nan_observation_lands_in_no_bucket() -> None:
    metrics = Metrics(pool="default")
    metrics.observe_ttft("m", float("nan"))
    metrics.observe_ttft("m", 0.02)
    bucket = metrics.registry.get_sample_value(
        "picker_time_to_first_token_seconds_bucket", {"model": "m", "le": "0.005"}
    )
    count = metrics.registry.get_sample_value("picker_time_to_first_token_seconds_count", {"model": "m"})
    assert (bucket, count) == (0.0, 1.0)
