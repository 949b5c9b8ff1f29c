"""Metrics: vLLM's names and labels, counters that move with traffic, one registry per replica."""

from __future__ import annotations

import httpx
import parity_checks as pc
from prometheus_client.parser import text_string_to_metric_families
from simkit import fast_config
from vllm_sim import Replica, run_sim

from loadtest import http_client
from loadtest.sse_client import stream_request


async def test_metric_names_and_labels(sim: Replica) -> None:
    await pc.check_metric_names(pc.Target(sim.url))


async def test_counters_follow_finished_requests(sim: Replica, client: httpx.AsyncClient) -> None:
    body = {
        "prompt": "hello world!",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = await stream_request(client, "/v1/completions", body)
    response = await client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    )
    usages = [result.usage, response.json()["usage"]]
    text = await pc.scrape(client)
    assert pc.metric_value(text, "vllm:request_success_total", finished_reason="length") == 2
    assert pc.metric_value(text, "vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages if u)
    assert pc.metric_value(text, "vllm:generation_tokens_total") == 12
    assert pc.metric_value(text, "vllm:time_to_first_token_seconds_count") == 2
    assert pc.metric_value(text, "vllm:e2e_request_latency_seconds_count") == 2
    assert pc.metric_value(text, "vllm:inter_token_latency_seconds_count") == 10  # tokens after the first
    assert pc.metric_value(text, "sim_requests_received_total") == 2
    assert pc.metric_value(text, "sim_requests_served_total") == 2
    assert pc.metric_value(text, "vllm:num_requests_running") == 0


async def test_exposition_has_vllm_types_and_created_samples(client: httpx.AsyncClient) -> None:
    text = await pc.scrape(client)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["vllm:admission_rejections"].type == "counter"
    assert families["vllm:inter_token_latency_seconds"].type == "histogram"
    assert families["vllm:num_requests_waiting_by_reason"].type == "gauge"
    assert 'vllm:request_success_created{engine="0",finished_reason="abort",model_name="tiny-llama"}' in text
    response = await client.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")


async def test_each_replica_has_its_own_metrics() -> None:
    async with run_sim(fast_config(), ports=[0, 0]) as (first, second):
        async with http_client.AsyncClient(base_url=first.url) as http:
            await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            first_text = await pc.scrape(http)
        async with http_client.AsyncClient(base_url=second.url) as http:
            second_text = await pc.scrape(http)
    assert pc.metric_value(first_text, "sim_requests_received_total") == 1
    assert pc.metric_value(second_text, "sim_requests_received_total") == 0
    assert first.port != second.port
