"""Routing through the real Envoy: streams and plain responses, HTTP/1.1 and h2c, load spread."""

from __future__ import annotations

import asyncio
import json
import signal

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack
from loadtest.traffic import REPLICA_HEADER, completion_body, run_closed_loop, stream_one

pytestmark = pytest.mark.envoy


def chat_body(stream: bool) -> dict[str, object]:
    return {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
async def test_streaming_completion(clean_stack: Stack, http2: bool) -> None:
    async with http_client.AsyncClient(http1=not http2, http2=http2, timeout=10) as client:
        result = await stream_one(client, clean_stack.url, completion_body(8))
    assert result.ok, result
    assert result.chunks == 8
    assert result.replica in clean_stack.replicas


@pytest.mark.parametrize("http2", [False, True], ids=["http1", "h2c"])
async def test_non_streaming_completion_and_chat(clean_stack: Stack, http2: bool) -> None:
    async with http_client.AsyncClient(http1=not http2, http2=http2, timeout=10) as client:
        response = await client.post(
            clean_stack.url + "/v1/completions", json=completion_body(6, stream=False)
        )
        chat = await client.post(clean_stack.url + "/v1/chat/completions", json=chat_body(stream=False))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 6
    assert response.headers[REPLICA_HEADER] in clean_stack.replicas
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    if http2:
        assert response.http_version == "HTTP/2"


async def test_streaming_chat_with_usage(clean_stack: Stack) -> None:
    events: list[str] = []
    async with (
        http_client.AsyncClient(timeout=10) as client,
        client.stream(
            "POST", clean_stack.url + "/v1/chat/completions", json=chat_body(stream=True)
        ) as response,
    ):
        assert response.status_code == 200
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


async def test_models_endpoint_is_routed_without_a_body(clean_stack: Stack) -> None:
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.get(clean_stack.url + "/v1/models")
    assert response.status_code == 200
    assert response.json()["data"][0]["id"] == "tiny-llama"


async def test_concurrent_long_streams_spread_by_in_flight(clean_stack: Stack) -> None:
    # 30 streams start together and each lasts ~1 s: a picker that counted only the time to response
    # headers (or routed at random) would pile more than 12 on some replica.
    async with http_client.AsyncClient(timeout=20, limits=httpx.Limits(max_connections=40)) as client:
        results = await asyncio.gather(
            *(stream_one(client, clean_stack.url, completion_body(40)) for _ in range(30))
        )
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    per_replica = {replica: sum(r.replica == replica for r in results) for replica in clean_stack.replicas}
    assert sum(per_replica.values()) == 30
    assert max(per_replica.values()) <= 12, per_replica


async def test_closed_loop_traffic_has_no_failures(clean_stack: Stack) -> None:
    report = await run_closed_loop(
        clean_stack.url, concurrency=8, max_requests=80, deadline_s=20, max_tokens=10
    )
    assert len(report.results) == 80
    assert report.failures() == []
    assert set(report.by_replica()) == set(clean_stack.replicas)


async def test_response_headers_do_not_wait_for_the_picker(clean_stack: Stack) -> None:
    # The routing stream ends at its decision once this connection's observer has reported a
    # response, so a response's headers never wait on the picker (one round trip less before the
    # first token). Proof: with the picker frozen (SIGSTOP) after it routed a request, the response
    # still arrives. Were the routing filter still waiting for the picker's answer to the response
    # headers, Envoy would give up after its message_timeout (2 s) and answer 504 (measured).
    async with http_client.AsyncClient(timeout=30) as client:
        warm = await stream_one(client, clean_stack.url, completion_body(2))  # its observer reports
        assert warm.ok, warm
        running = clean_stack.sim_value("vllm:num_requests_running")
        # 120 tokens 25 ms apart: non-streaming, so its headers leave the replica after about 3 s
        pending = asyncio.create_task(
            client.post(clean_stack.url + "/v1/completions", json=completion_body(120, stream=False))
        )
        await asyncio.to_thread(
            wait_until,
            lambda: clean_stack.sim_value("vllm:num_requests_running") > running,
            10,
            what="the request to reach a replica",
        )
        clean_stack.picker.signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            response = await asyncio.wait_for(pending, 20)
        finally:
            clean_stack.picker.signal(signal.SIGCONT)  # type: ignore[union-attr]
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 120


async def test_the_access_log_times_the_pickers_part_of_each_request(clean_stack: Stack) -> None:
    # Operators see, per request, how long the routing filter waited for the picker in each phase
    # and how long the request took to leave for its replica (config/envoy.yaml's file access log).
    async with http_client.AsyncClient(timeout=10) as client:
        result = await stream_one(client, clean_stack.url, completion_body(2), {"x-request-id": "timed-1"})
        assert result.ok, result

    def entry() -> dict[str, object] | None:
        for line in clean_stack.access_log.read_text().splitlines():
            record = json.loads(line)
            if record.get("request_id") == "timed-1":
                return record  # type: ignore[no-any-return]
        return None

    await asyncio.to_thread(wait_until, lambda: entry() is not None, 10, what="the access-log entry")
    timed = entry()
    assert timed is not None
    headers_us, body_us = int(str(timed["picker_headers_us"])), int(str(timed["picker_body_us"]))
    to_upstream_us = int(str(timed["to_upstream_us"]))
    assert headers_us > 0 and body_us > 0
    assert to_upstream_us >= headers_us + body_us  # the picker's phases come before the upstream request
