"""Capacity model: running slots, the waiting queue, the 503 beyond it, KV usage."""

from __future__ import annotations

import asyncio

import httpx
import parity_checks as pc
from simkit import fast_config, sim_requests
from vllm_sim import CapacityConfig, run_sim
from vllm_sim.engine import Admission, Engine, InFlight
from vllm_sim.requestlog import RequestRecord

from loadtest import http_client
from loadtest.sse_client import stream_request

BUSY_BODY = {
    "error": {
        "message": "The engine is currently busy and cannot accept new requests. "
        "Please try again later or on a different instance.",
        "type": "Service Unavailable",
        "param": None,
        "code": 503,
    }
}


def flight(prompt_tokens: int = 10) -> InFlight:
    return InFlight(asyncio.get_running_loop(), RequestRecord("r", "/v1/completions", 0.0), prompt_tokens)


async def test_engine_admits_queues_rejects_and_promotes_in_order() -> None:
    engine = Engine(CapacityConfig(max_num_seqs=1, max_num_queued_reqs=2))
    first, second, third, fourth = flight(), flight(), flight(), flight()
    assert engine.admit(first) is Admission.RUNNING
    assert engine.admit(second) is Admission.QUEUED
    assert engine.admit(third) is Admission.QUEUED
    assert engine.admit(fourth) is Admission.REJECTED
    engine.release(third)  # a queued request leaving frees its queue place only
    assert list(engine.waiting) == [second] and engine.running == {first}
    engine.release(first)
    assert engine.running == {second} and second.running and not engine.waiting
    engine.release(first)  # idempotent
    engine.release(second)
    assert engine.running == set() and engine.tokens_held == 0


async def test_engine_counts_kv_tokens_and_blocks_on_kv() -> None:
    engine = Engine(CapacityConfig(max_num_seqs=8, kv_capacity_tokens=100))
    big, other = flight(60), flight(60)
    assert engine.admit(big) is Admission.RUNNING
    engine.add_tokens(big, 15)
    assert engine.tokens_held == 75 and engine.kv_usage == 0.75
    assert engine.admit(other) is Admission.QUEUED  # a slot is free, the KV cache is not
    engine.release(big)
    assert other.running and engine.tokens_held == 60


async def metric(http: httpx.AsyncClient, name: str, **labels: str) -> float:
    return pc.metric_value(await pc.scrape(http), name, **labels)


async def test_queue_then_503_with_vllms_body() -> None:
    config = fast_config(capacity=CapacityConfig(max_num_seqs=2, max_num_queued_reqs=2))
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=10) as http,
    ):
        body = {"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True}
        streams = [
            asyncio.create_task(stream_request(http, "/v1/completions", body, read_timeout=5))
            for _ in range(4)
        ]
        assert await pc.wait_until(lambda: len(replica.state.engine.waiting) == 2, 5)
        assert await metric(http, "vllm:num_requests_running") == 2
        assert await metric(http, "vllm:num_requests_waiting") == 2
        rejected = await http.post("/v1/completions", json=body)
        assert rejected.status_code == 503 and rejected.json() == BUSY_BODY
        assert "retry-after" not in rejected.headers
        assert await metric(http, "vllm:admission_rejections_total") == 1
        assert await metric(http, "sim_requests_rejected_total", reason="queue-full") == 1
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)


async def test_queued_stream_gets_headers_at_once_and_first_token_when_a_slot_frees() -> None:
    config = fast_config(capacity=CapacityConfig(max_num_seqs=1))
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=10) as http,
    ):
        running = asyncio.create_task(
            stream_request(
                http,
                "/v1/completions",
                {"prompt": "x", "max_tokens": 40, "ignore_eos": True, "stream": True},
                headers={"x-request-id": "running"},
            )
        )
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        async with http.stream(
            "POST",
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 3, "stream": True},
            headers={"x-request-id": "queued"},
        ) as queued:
            assert queued.status_code == 200  # headers while the request waits for a slot
            assert len(replica.state.engine.waiting) == 1 and not running.done()
            body = (await queued.aread()).decode()
        assert body.count("data: ") == 4
        await running
        (first,) = await sim_requests(replica.url, "running")
        (second,) = await sim_requests(replica.url, "queued")
        assert second["first_token_at"] >= first["end"]


async def test_kv_usage_follows_tokens_held() -> None:
    config = fast_config(capacity=CapacityConfig(kv_capacity_tokens=1000))
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=10) as http,
    ):
        body = {
            "prompt": "p" * 400,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
        }  # 100 prompt tokens
        stream = asyncio.create_task(stream_request(http, "/v1/completions", body, read_timeout=5))
        assert await pc.wait_until(lambda: replica.state.engine.tokens_held > 150, 5)
        usage = await metric(http, "vllm:kv_cache_usage_perc")
        assert 0.15 < usage <= 1.0
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        assert await pc.wait_until(lambda: replica.state.engine.tokens_held == 0, 2)
        assert await metric(http, "vllm:kv_cache_usage_perc") == 0.0
