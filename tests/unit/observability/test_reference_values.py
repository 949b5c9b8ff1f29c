"""The reference's names (picker/observability/reference/) carry the same values as the picker's own
names for the same fact, after traffic through the request path; and the reference's pool saturation
is its utilization figure, from the pick's thresholds, whatever is known of slot counts."""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import CollectorRegistry

from picker.contract import Outcome, reply_for
from picker.observability.metrics import Metrics
from picker.observability.reference import pool_saturation
from picker.pool import EndpointState, Pool
from picker.pool.load import LoadSample
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.streams import EndReason

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
POOL = "vllm-llama"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sample(waiting: float, kv: float, running: float = 0.0, at: float = 100.0) -> LoadSample:
    return LoadSample(
        running=running, waiting=waiting, kv_usage=kv, at=at, arrivals_before=0, departures_after=0
    )


def sse(text: str) -> bytes:
    event = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    event["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]  # type: ignore[assignment]
    return f"data: {json.dumps(event)}\n\n".encode()


def served(requests: int = 3, tokens: int = 4) -> tuple[Metrics, Clock, RequestPath]:
    """A path over two scraped replicas that served `requests` streams of `tokens` chunks, a queue of
    none, and one request refused (not JSON)."""
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B])
    pool.get(A).load = sample(waiting=1, kv=0.3, running=2)  # type: ignore[union-attr]
    pool.get(B).load = sample(waiting=3, kv=0.6, running=5)  # type: ignore[union-attr]
    metrics = Metrics(CollectorRegistry(), pool=POOL)
    metrics.register_pool(pool)
    path = RequestPath(
        pool,
        metrics,
        fallback_count=1,
        load_policy=LoadPolicy(waiting_threshold=100, kv_threshold=0.99, staleness_s=1e9),
        clock=clock,
        rng=random.Random(3),
        schedule=lambda delay, fn: lambda: None,
    )
    for i in range(requests):
        model = "m" if i % 2 else "n"
        record = path.admit(InferenceRequest(method="POST", path="/v1/completions", model=model)).payload
        clock.now += 0.01 * (i + 1)
        path.response_started(record, 200, record.picked[0], streaming=True)
        for _ in range(tokens):
            clock.now += 0.002
            path.body_chunk(record, sse("tok"))
        path.response_ended(record, True, EndReason.UPSTREAM_TRUNCATED)
    return metrics, clock, path


def value(metrics: Metrics, metric: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(metric, labels)
    assert found is not None, f"{metric}{labels} is not on the page"
    return found


def total(metrics: Metrics, name: str) -> float:
    return sum(s.value for family in metrics.registry.collect() for s in family.samples if s.name == name)


def test_ttft_carries_the_same_count_and_sum_under_both_names() -> None:
    metrics, _, _ = served()
    for model in ("m", "n"):
        for suffix in ("_count", "_sum"):
            ours = value(metrics, f"picker_time_to_first_token_seconds{suffix}", model=model)
            theirs = value(
                metrics,
                f"inference_objective_request_ttft_seconds{suffix}",
                model_name=model,
                target_model_name=model,
            )
            assert theirs == ours
    assert value(metrics, "picker_time_to_first_token_seconds_count", model="n") == 2


def test_output_tokens_total_is_the_sum_of_the_output_token_histogram() -> None:
    metrics, _, _ = served(requests=3, tokens=4)
    for model in ("m", "n"):
        labels = {"model_name": model, "target_model_name": model}
        assert value(metrics, "picker_output_tokens_total", model=model) == value(
            metrics, "inference_objective_output_tokens_sum", **labels
        )
    assert total(metrics, "picker_output_tokens_total") == 3 * 4
    assert total(metrics, "inference_objective_output_tokens_count") == 3


def test_picks_and_admit_time_match_the_pickers_own() -> None:
    metrics, _, path = served(requests=3)
    assert total(metrics, "inference_objective_request_total") == total(metrics, "picker_picks_total") == 3
    for suffix in ("_count", "_sum"):
        ours = value(metrics, f"picker_pick_duration_seconds{suffix}")
        assert value(metrics, f"inference_extension_scheduler_e2e_duration_seconds{suffix}") == ours
        assert (
            value(metrics, f"inference_extension_flow_control_dispatch_cycle_duration_seconds{suffix}")
            == ours
        )
    path.reject(reply_for(Outcome.BAD_REQUEST))
    assert total(metrics, "inference_objective_request_error_total") == 1
    assert total(metrics, "inference_objective_request_duration_seconds_count") == 3


def test_queue_size_and_wait_match_the_pickers_own() -> None:
    metrics, _, path = served(requests=2)
    flow = {
        "fairness_id": "",
        "priority": "",
        "inference_pool": POOL,
        "model_name": "",
        "target_model_name": "",
    }
    for name in ("queue_size", "queue_bytes"):
        ours = value(metrics, f"picker_flow_{name}", pool=POOL)
        assert value(metrics, f"inference_extension_flow_control_{name}", **flow) == ours
    assert value(metrics, "inference_extension_flow_control_queue_size", **flow) == path.flow.queued
    theirs = value(
        metrics,
        "inference_extension_flow_control_request_queue_duration_seconds_count",
        **flow,
        outcome="Dispatched",
    )
    assert theirs == value(metrics, "picker_flow_wait_seconds_count", outcome=Outcome.DISPATCHED.value) == 2


def test_pool_gauges_are_the_engine_gauges_averaged() -> None:
    metrics, _, _ = served(requests=0)
    for ours, theirs in (
        ("running", "average_running_requests"),
        ("waiting", "average_queue_size"),
        ("kv_usage", "average_kv_cache_utilization"),
    ):
        each = [value(metrics, f"picker_endpoint_engine_{ours}", endpoint=e) for e in (A, B)]
        assert value(metrics, f"inference_pool_{theirs}", name=POOL) == pytest.approx(sum(each) / 2)
    for address in (A, B):
        assert value(
            metrics, "inference_pool_per_pod_queue_size", name=POOL, model_server_pod=address
        ) == value(metrics, "picker_endpoint_engine_waiting", endpoint=address)
    assert value(metrics, "inference_pool_ready_pods", name=POOL) == value(metrics, "picker_ready_endpoints")


def test_saturation_is_the_mean_of_each_ready_replicas_most_used_resource() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B, C], draining=["10.0.0.4:8000"])
    policy = LoadPolicy(waiting_threshold=4, kv_threshold=0.8, staleness_s=2.0)
    pool.get(A).load = sample(waiting=2, kv=0.2)  # type: ignore[union-attr]  # queue: 0.5
    pool.get(B).load = sample(waiting=0, kv=0.6)  # type: ignore[union-attr]  # KV: 0.75
    pool.get("10.0.0.4:8000").load = sample(waiting=40, kv=1.0)  # type: ignore[union-attr]  # not READY
    # C has no figures yet: counted 1, never idle
    assert pool_saturation(pool.endpoints(), policy, clock.now) == pytest.approx((0.5 + 0.75 + 1.0) / 3)
    clock.now += 2.5  # every figure stale: each counts 1
    assert pool_saturation(pool.endpoints(), policy, clock.now) == 1.0
    assert pool_saturation([], policy, clock.now) == 1.0  # no READY replica: saturated


def test_saturation_answers_while_slot_counts_are_unknown_and_is_absent_without_scraping() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    pool.get(A).load = sample(waiting=1, kv=0.45)  # type: ignore[union-attr]
    for policy, expected in ((LoadPolicy(kv_threshold=0.9), 1.0), (LoadPolicy(use_metrics=False), None)):
        metrics = Metrics(CollectorRegistry(), pool=POOL)
        metrics.register_pool(pool)
        metrics.register_load_policy(policy, clock)
        saturation = metrics.registry.get_sample_value(
            "inference_extension_flow_control_pool_saturation", {"inference_pool": POOL}
        )
        assert saturation == expected  # waiting 1 / 1 beats KV 0.45 / 0.9
        assert metrics.registry.get_sample_value("picker_pool_saturation", {"pool": POOL}) is None
    assert pool.get(A).state is EndpointState.READY  # type: ignore[union-attr]


def test_the_recorded_facts_read_as_prometheus_clients_own_histograms_would() -> None:
    """The per-model plain numbers (reference/recorded.py) against a prometheus_client Histogram and
    Counter fed the same values: the same samples, bucket by bucket; a NaN is dropped whole (in no
    bucket, as prometheus_client, and not in the sum, which it would poison for good)."""
    from prometheus_client import Counter, Histogram

    from picker.observability.reference.recorded import HISTOGRAMS

    metrics = Metrics(CollectorRegistry(), pool=POOL)
    twin = CollectorRegistry()
    names = ("duration_s", "tpot_s", "request_bytes", "response_bytes", "prompt_tokens")
    models = ["m", "n", "m"]
    rows = [(0.004, 0.0005, 64, 1, 1), (0.4, 0.05, 900, 2400, 60), (3600.0, 360.0, 2**30, 65536, 1048576)]
    twins = {
        name: Histogram(
            f"inference_objective_{name}",
            "",
            ["model_name", "target_model_name"],
            buckets=bounds,
            registry=twin,
        )
        for name, _, bounds in HISTOGRAMS
    }
    requests = Counter(
        "inference_objective_request", "", ["model_name", "target_model_name", "priority"], registry=twin
    )
    order = (
        "request_duration_seconds",
        "request_tpot_seconds",
        "request_sizes",
        "response_sizes",
        "input_tokens",
    )
    for model, row in zip(models, rows, strict=True):
        metrics.reference.picked(model, 1)
        requests.labels(model, model, "1").inc()
        metrics.reference.ended(model, **dict(zip(names, row, strict=True)))  # type: ignore[arg-type]
        metrics.reference.produced(model, int(row[4]) % 9000)
        twins["output_tokens"].labels(model, model).observe(int(row[4]) % 9000)
        for name, amount in zip(order, row, strict=True):
            twins[name].labels(model, model).observe(amount)

    def page(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in registry.collect()
            for s in family.samples
            if s.name.startswith("inference_objective_")
            and not s.name.endswith("_created")
            and "error" not in s.name
            and "ttft" not in s.name
            and "running" not in s.name
        }

    ours, theirs = page(metrics.registry), page(twin)
    assert set(ours) == set(theirs)
    for key, expected in theirs.items():
        assert ours[key] == pytest.approx(expected), key
    nan = float("nan")
    metrics.reference.ended(
        "m", duration_s=nan, request_bytes=1, response_bytes=1, prompt_tokens=1, tpot_s=nan
    )
    after = page(metrics.registry)
    for key in ("inference_objective_request_duration_seconds", "inference_objective_request_tpot_seconds"):
        for suffix in ("_sum", "_count"):
            labels = (("model_name", "m"), ("target_model_name", "m"))
            assert after[(key + suffix, labels)] == ours[(key + suffix, labels)]


class _Queue:
    queued = 5
    queued_bytes = 5000


def test_queue_size_by_fairness_id_with_fair_share_on_sums_to_the_pickers_own() -> None:
    """tenants.fair_share on: the reference's queue size is split by tenant from the tenants' rows
    (picker_tenant_queued's labels), the requests without a tenant under a blank fairness_id."""
    from picker.flow.tenants import FairShare, Tenants

    tenants = Tenants(FairShare(weights={"gold": 2.0}), lambda: None)
    for name, queued in (("gold", 2), ("bronze", 1), ("idle", 0)):
        tenants.arrived(name)
        tenants.queued(name, queued)
    metrics = Metrics(CollectorRegistry(), pool=POOL)
    metrics.register_flow(_Queue())
    metrics.register_tenants(tenants)
    flow = {"priority": "", "inference_pool": POOL, "model_name": "", "target_model_name": ""}
    size = "inference_extension_flow_control_queue_size"
    by_tenant = {t: value(metrics, size, fairness_id=t, **flow) for t in ("gold", "bronze", "idle", "")}
    assert by_tenant == {"gold": 2, "bronze": 1, "idle": 0, "": 2}
    assert total(metrics, size) == value(metrics, "picker_flow_queue_size", pool=POOL) == 5
    for tenant in ("gold", "bronze"):
        assert by_tenant[tenant] == value(metrics, "picker_tenant_queued", tenant=tenant)
    assert value(metrics, "inference_extension_flow_control_queue_bytes", fairness_id="", **flow) == 5000
