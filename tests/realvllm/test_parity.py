"""What a real vLLM 0.32 (CPU build) does, checked live: the behaviour the picker and the simulator rely on.

Where the simulator and these checks disagree, the simulator is wrong. Facts first measured in
/work/shared/reference/vllm-measured.md; each check here can fail if vLLM changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from loadtest.realvllm import launcher

# Fixture setup (a vLLM start, 23-26 s idle, much more on a busy box) counts against the timeout.
pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

PROMPT = "def handle_request(pool, request):\n    "
CHAT_MESSAGES = [{"role": "user", "content": "Pick a replica for this request."}]
# ~20 s of decoding at 360-400 tok/s: outlives every disconnect check, which abort it early.
ABORTED_STREAM_TOKENS = 8000
# ~15 s of decoding: still generating when the drain checks run on a busy box; well under the timeout.
DRAINED_STREAM_TOKENS = 6000
DRAIN_TIMEOUT_S = 60
# What a draining vLLM answers new text requests: its tokenizer pool is already shut down.
SHUTDOWN_REFUSAL = "cannot schedule new futures after shutdown"
# vLLM frees a disconnected request within one engine step (measured < 0.4 s); 10 s leaves room for a
# loaded 2-core CI box without letting a request that is never aborted (~20 s) pass.
ABORT_DEADLINE_S = 10.0
REQUIRED_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_success": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
}


# ---------------------------------------------------------------------------------------------- helpers


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float, interval: float = 0.05) -> bool:
    """Poll an async condition until it holds or the deadline passes; returns whether it held."""
    deadline = time.monotonic() + within_s
    while True:
        if await check():
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def completion_body(max_tokens: int, stream: bool, model: str = launcher.SERVED_MODEL_NAME) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_body(max_tokens: int, model: str = launcher.SERVED_MODEL_NAME) -> dict[str, Any]:
    return {
        "model": model,
        "messages": CHAT_MESSAGES,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def sse_payloads(response: httpx.Response) -> AsyncIterator[str]:
    """Yield the payload of each `data: <payload>\\n\\n` frame, checking the framing as it goes."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        while "\n\n" in buffer:
            frame, buffer = buffer.split("\n\n", 1)
            assert frame.startswith("data: ") and "\n" not in frame, f"not a data frame: {frame[:120]!r}"
            yield frame.removeprefix("data: ")
    assert buffer == "", f"stream ended mid-frame: {buffer[:120]!r}"


def check_finished_stream(payloads: list[str], object_name: str, max_tokens: int) -> list[dict[str, Any]]:
    """Assert the shape of a stream that ran to max_tokens; returns its JSON chunks."""
    assert payloads and payloads[-1] == "[DONE]", f"stream did not end with [DONE]: {payloads[-2:]}"
    assert payloads.count("[DONE]") == 1
    chunks = [json.loads(payload) for payload in payloads[:-1]]
    assert all("error" not in chunk for chunk in chunks), [c for c in chunks if "error" in c]
    assert {chunk["object"] for chunk in chunks} == {object_name}
    assert {chunk["model"] for chunk in chunks} == {launcher.SERVED_MODEL_NAME}
    assert len({chunk["id"] for chunk in chunks}) == 1, "all chunks of one stream share its id"
    *content_chunks, usage_chunk = chunks
    # With include_usage the last chunk carries usage and no choices; the last content chunk the reason.
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == max_tokens
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    reasons = [choice["finish_reason"] for chunk in content_chunks for choice in chunk["choices"]]
    assert reasons[-1] == "length"
    assert all(reason is None for reason in reasons[:-1])
    assert all("usage" not in chunk or chunk["usage"] is None for chunk in content_chunks)
    return chunks


def metric_samples(exposition: str) -> list[Sample]:
    return [sample for family in text_string_to_metric_families(exposition) for sample in family.samples]


async def scrape(client: httpx.AsyncClient) -> list[Sample]:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return metric_samples(response.text)


def metric_value(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum of the tiny-llama samples called `name` whose labels include `labels`."""
    wanted = {"model_name": launcher.SERVED_MODEL_NAME, **labels}
    matching = [s.value for s in samples if s.name == name and wanted.items() <= s.labels.items()]
    assert matching, f"no sample {name}{wanted}"
    return sum(matching)


async def gauges_settle_to_idle(client: httpx.AsyncClient) -> bool:
    samples = await scrape(client)
    return (
        metric_value(samples, "vllm:num_requests_running") == 0
        and metric_value(samples, "vllm:kv_cache_usage_perc") == 0
    )


async def one_running(client: httpx.AsyncClient) -> bool:
    return metric_value(await scrape(client), "vllm:num_requests_running") == 1


def check_error_body(response: httpx.Response, status: int, error_type: str, message_part: str) -> None:
    """vLLM's OpenAI-style error: {"error": {"message", "type", "param", "code"}} with code == status."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status
    assert error["type"] == error_type
    assert message_part in error["message"]
    assert "param" in error


# ------------------------------------------------------------------------ checks on one shared server


class TestServing:
    """Checks that leave the server healthy, so they share one vLLM start."""

    async def test_health_is_200_with_empty_body(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as client:
            response = await client.get("/health")
        assert response.status_code == 200
        assert response.content == b""

    async def test_models_lists_the_served_name(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as client:
            response = await client.get("/v1/models")
        assert response.status_code == 200
        listing = response.json()
        assert listing["object"] == "list"
        assert [model["id"] for model in listing["data"]] == [vllm_server.model]
        assert listing["data"][0]["owned_by"] == "vllm"
        assert listing["data"][0]["max_model_len"] == 8192

    async def test_completion_stream_format(self, vllm_server: launcher.RealVllm) -> None:
        async with (
            httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=completion_body(24, stream=True)) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            payloads = [payload async for payload in sse_payloads(response)]
        chunks = check_finished_stream(payloads, "text_completion", 24)
        assert all(isinstance(chunk["choices"][0]["text"], str) for chunk in chunks[:-1])

    async def test_chat_stream_format(self, vllm_server: launcher.RealVllm) -> None:
        async with (
            httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=chat_body(24)) as response,
        ):
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            payloads = [payload async for payload in sse_payloads(response)]
        chunks = check_finished_stream(payloads, "chat.completion.chunk", 24)
        # The first chunk announces the role with empty content; the rest carry content deltas.
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("content" in chunk["choices"][0]["delta"] for chunk in chunks[1:-1])

    async def test_unknown_model_is_404(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as client:
            completion = await client.post("/v1/completions", json=completion_body(4, False, model="nope"))
            chat = await client.post("/v1/chat/completions", json=chat_body(4, model="nope"))
        for response in (completion, chat):
            check_error_body(response, 404, "NotFoundError", "The model `nope` does not exist.")
            assert response.json()["error"]["param"] == "model"

    async def test_malformed_json_is_400(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=30) as client:
            response = await client.post(
                "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
            )
        # Not "BadRequestError" like the engine's own 400s: FastAPI's validation wording.
        check_error_body(response, 400, "Bad Request", "JSON decode error")

    async def test_metric_names_labels_and_counters(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
            before = await scrape(client)
            response = await client.post("/v1/completions", json=completion_body(12, stream=False))
            assert response.status_code == 200
            usage = response.json()["usage"]

            def grew_by(samples: list[Sample], name: str, amount: float, **labels: str) -> bool:
                return metric_value(samples, name, **labels) - metric_value(before, name, **labels) == amount

            async def counters_caught_up() -> bool:
                after = await scrape(client)
                return (
                    grew_by(after, "vllm:request_success_total", 1, finished_reason="length")
                    and grew_by(after, "vllm:prompt_tokens_total", usage["prompt_tokens"])
                    and grew_by(after, "vllm:generation_tokens_total", usage["completion_tokens"])
                    and grew_by(after, "vllm:e2e_request_latency_seconds_count", 1)
                    and grew_by(after, "vllm:time_to_first_token_seconds_count", 1)
                )

            assert await eventually(counters_caught_up, within_s=10)
            families = {
                family.name: family
                for family in text_string_to_metric_families((await client.get("/metrics")).text)
            }
        for name, kind in REQUIRED_METRICS.items():
            assert families[name].type == kind, name
            for sample in families[name].samples:
                assert sample.labels["engine"] == "0", sample
                assert sample.labels["model_name"] == vllm_server.model, sample
        reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
        assert reasons == {"stop", "length", "abort", "error", "repetition"}
        kv_usage = families["vllm:kv_cache_usage_perc"].samples[0].value
        assert 0.0 <= kv_usage <= 1.0, "a fraction, not a percentage"

    async def test_stream_disconnect_aborts_the_request(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as metrics_client:
            before = await scrape(metrics_client)
            async with (
                httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client,
                client.stream(
                    "POST", "/v1/completions", json=completion_body(ABORTED_STREAM_TOKENS, stream=True)
                ) as response,
            ):
                assert response.status_code == 200
                payloads = sse_payloads(response)
                for _ in range(5):
                    await anext(payloads)
                assert await eventually(lambda: one_running(metrics_client), within_s=10)
                await payloads.aclose()
            # Leaving the block closed the connection mid-stream.
            assert await eventually(lambda: gauges_settle_to_idle(metrics_client), ABORT_DEADLINE_S)
            await check_abort_not_counted(metrics_client, before)

    async def test_non_streaming_disconnect_aborts_the_request(self, vllm_server: launcher.RealVllm) -> None:
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as metrics_client:
            before = await scrape(metrics_client)
            async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
                request = asyncio.create_task(
                    client.post("/v1/completions", json=completion_body(ABORTED_STREAM_TOKENS, stream=False))
                )
                assert await eventually(lambda: one_running(metrics_client), within_s=10)
                assert not request.done()
                request.cancel()  # drops the connection while vLLM is still generating
                with contextlib.suppress(asyncio.CancelledError):
                    await request
            assert await eventually(lambda: gauges_settle_to_idle(metrics_client), ABORT_DEADLINE_S)
            await check_abort_not_counted(metrics_client, before)


async def check_abort_not_counted(client: httpx.AsyncClient, before: list[Sample]) -> None:
    """A client-side abort leaves request_success_total and the latency histograms untouched."""
    after = await scrape(client)
    for reason in ("abort", "length", "error"):
        name = "vllm:request_success_total"
        assert metric_value(after, name, finished_reason=reason) == metric_value(
            before, name, finished_reason=reason
        ), reason
    latency_count = "vllm:e2e_request_latency_seconds_count"
    assert metric_value(after, latency_count) == metric_value(before, latency_count)


# --------------------------------------------------------------------------------- drain on SIGTERM


async def post_on_new_connection(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request on its own connection: vLLM drops the connection after a drain-time 500."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(path, json=body)


async def get_on_new_connection(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.get(path)


async def first_refusal(url: str, attempts: int = 200, within_s: float = 30) -> httpx.Response | None:
    """Send tiny completions until one is refused (the drain has begun); None if all were accepted."""
    deadline = time.monotonic() + within_s
    for _ in range(attempts):
        response = await post_on_new_connection(url, "/v1/completions", completion_body(1, stream=False))
        if response.status_code != 200:
            return response
        if time.monotonic() > deadline:
            break
    return None


async def test_sigterm_drain_finishes_inflight_stream_and_refuses_new_work(vllm_workdir: Path) -> None:
    port = launcher.free_port()
    with launcher.real_vllm(port, vllm_workdir, shutdown_timeout=DRAIN_TIMEOUT_S) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as stream_client,
            stream_client.stream(
                "POST", "/v1/completions", json=completion_body(DRAINED_STREAM_TOKENS, stream=True)
            ) as response,
        ):
            assert response.status_code == 200
            payloads = sse_payloads(response)
            received = [await anext(payloads) for _ in range(3)]
            running = metric_value(
                metric_samples((await get_on_new_connection(server.url, "/metrics")).text),
                "vllm:num_requests_running",
            )
            assert running == 1, "the stream must still be generating when SIGTERM lands"
            server.terminate()

            refusal = await first_refusal(server.url)
            assert refusal is not None, "new completions still accepted after SIGTERM"
            check_error_body(refusal, 500, "InternalServerError", SHUTDOWN_REFUSAL)
            print("REFUSAL HEADERS", dict(refusal.headers))
            chat_refusal = await post_on_new_connection(server.url, "/v1/chat/completions", chat_body(1))
            check_error_body(chat_refusal, 500, "InternalServerError", SHUTDOWN_REFUSAL)
            # Draining, yet still advertised healthy: a health check alone does not see the drain.
            assert (await get_on_new_connection(server.url, "/health")).status_code == 200
            assert (await get_on_new_connection(server.url, "/v1/models")).status_code == 200
            metrics = await get_on_new_connection(server.url, "/metrics")
            running = metric_value(metric_samples(metrics.text), "vllm:num_requests_running")
            assert running == 1, "the stream is still in flight while /health answers 200"

            received += [payload async for payload in payloads]
        check_finished_stream(received, "text_completion", DRAINED_STREAM_TOKENS)

        assert launcher.wait_until(lambda: not launcher.port_accepts(port), timeout=30), server.log_tail()
        exit_code = server.wait_exit(timeout=30)
        assert exit_code is not None, f"still running after the drain:\n{server.log_tail()}"
