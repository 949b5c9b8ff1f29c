"""Behaviour checks that hold for the simulator AND for a real vLLM 0.32: run them against both.

Nothing here uses a simulator-only feature (no x-sim-* header, no /sim route): long streams come from
max_tokens + ignore_eos, sized by the caller to its server's speed (sim at 10 ms/token: 300 tokens ~ 3 s;
real vLLM CPU at ~370 tok/s: 3000 tokens ~ 8 s). Each check raises AssertionError with the evidence.

From another test directory (tests/ is a package, tests/sim a namespace portion of it):

    from tests.sim import parity_checks as pc
    target = pc.Target(server.url, model=server.model, sigterm=server.terminate)
    await pc.check_sse_format(target)
    await pc.check_drain_on_sigterm(target, stream_tokens=3000)   # server started with --shutdown-timeout
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import http_client
from loadtest.sse_client import StreamResult, stream_request

DRAIN_REFUSAL = "cannot schedule new futures after shutdown"
ENGINE_ERROR = "EngineCore encountered an issue"
REQUIRED_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_success": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter",  # in tokens (cache-aware routing reads the hit rate)
    "vllm:prefix_cache_hits": "counter",
}
FINISHED_REASONS = {"stop", "length", "abort", "error", "repetition"}


@dataclass(frozen=True)
class Target:
    base_url: str
    model: str = "tiny-llama"
    sigterm: Callable[[], None] | None = None  # sends SIGTERM to the server (drain / abort checks)


async def wait_until(
    predicate: Callable[[], bool | Awaitable[bool]], within_s: float, interval: float = 0.01
) -> bool:
    """Poll a (sync or async) condition until it holds or `within_s` passes; returns whether it held."""
    deadline = time.monotonic() + within_s
    while True:
        outcome = predicate()
        if inspect.isawaitable(outcome):
            outcome = await outcome
        if outcome:
            return True
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)


def completion_body(target: Target, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": "def handle_request(pool, request):\n    ",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def chat_body(target: Target, max_tokens: int, stream: bool = True) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": target.model,
        "messages": [{"role": "user", "content": "Pick a replica for this request."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def metric_samples(exposition: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
    }


def metric_value(exposition: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`; AssertionError when none."""
    wanted = set(labels.items())
    values = [
        v
        for (n, sample_labels), v in metric_samples(exposition).items()
        if n == name and wanted <= sample_labels
    ]
    assert values, f"no sample {name}{labels}"
    return sum(values)


async def scrape(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200, response.status_code
    return response.text


async def running(client: httpx.AsyncClient, target: Target) -> float:
    return metric_value(await scrape(client), "vllm:num_requests_running", model_name=target.model)


async def port_refuses(base_url: str) -> bool:
    """True when a TCP connect to the server is refused (its listener is closed)."""
    parts = urlsplit(base_url)
    try:
        _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    writer.close()
    return False


def check_error(response: httpx.Response, status: int, error_type: str, message_part: str) -> None:
    """vLLM's error body: {"error": {"message", "type", "param", "code"}} with code == status."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status, error
    assert error["type"] == error_type, error
    assert message_part in error["message"], error
    assert "param" in error, error


def check_sse_frames(raw: bytes) -> list[str]:
    """Every frame is exactly `data: <one line>\\n\\n`, the last one `data: [DONE]`; returns payloads."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-200:]
    frames = text[:-2].split("\n\n")
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame and "\r" not in frame, frame[:200]
    payloads = [frame.removeprefix("data: ") for frame in frames]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1, payloads[-3:]
    return payloads


def check_finished_stream(
    result: StreamResult, obj: str, target: Target, max_tokens: int
) -> list[dict[str, Any]]:
    """A stream that ran to max_tokens: shape, one id, finish_reason on the last content chunk, usage."""
    assert result.status == 200, (result.status, result.raw[:300])
    assert result.headers["content-type"].startswith("text/event-stream")
    payloads = check_sse_frames(result.raw)
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all("error" not in c for c in chunks), [c for c in chunks if "error" in c]
    assert {c["object"] for c in chunks} == {obj}
    assert {c["model"] for c in chunks} == {target.model}
    assert len({c["id"] for c in chunks}) == 1
    *content, usage_chunk = chunks
    assert usage_chunk["choices"] == [], usage_chunk
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == max_tokens, usage
    assert (
        usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        and usage["prompt_tokens"] > 0
    )
    reasons = [choice["finish_reason"] for c in content for choice in c["choices"]]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1]), reasons[-3:]
    assert all(c.get("usage") is None for c in content)
    return chunks


async def check_health_and_models(target: Target) -> None:
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as client:
        health = await client.get("/health")
        models = await client.get("/v1/models")
    assert health.status_code == 200 and health.content == b""
    assert models.status_code == 200
    listing = models.json()
    assert listing["object"] == "list" and [m["id"] for m in listing["data"]] == [target.model]
    assert listing["data"][0]["owned_by"] == "vllm"


async def check_sse_format(target: Target, max_tokens: int = 16) -> None:
    async with http_client.AsyncClient(base_url=target.base_url) as client:
        completion = await stream_request(
            client, "/v1/completions", completion_body(target, max_tokens, True)
        )
        chat = await stream_request(client, "/v1/chat/completions", chat_body(target, max_tokens))
    chunks = check_finished_stream(completion, "text_completion", target, max_tokens)
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(isinstance(c["choices"][0]["text"], str) for c in chunks[:-1])
    chunks = check_finished_stream(chat, "chat.completion.chunk", target, max_tokens)
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:-1])


async def check_non_streaming(target: Target, max_tokens: int = 8) -> None:
    async with http_client.AsyncClient(base_url=target.base_url, timeout=60) as client:
        completion = await client.post("/v1/completions", json=completion_body(target, max_tokens, False))
        chat = await client.post("/v1/chat/completions", json=chat_body(target, max_tokens, stream=False))
    for response, obj in ((completion, "text_completion"), (chat, "chat.completion")):
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == obj and body["model"] == target.model
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == max_tokens
    assert completion.json()["id"].startswith("cmpl-") and chat.json()["id"].startswith("chatcmpl-")
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"


async def check_unknown_model_404(target: Target) -> None:
    nope = Target(target.base_url, model="nope")
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as client:
        completion = await client.post("/v1/completions", json=completion_body(nope, 4, False))
        chat = await client.post("/v1/chat/completions", json=chat_body(nope, 4))
    for response in (completion, chat):
        check_error(response, 404, "NotFoundError", "The model `nope` does not exist.")
        assert response.json()["error"]["param"] == "model"


async def check_malformed_json_400(target: Target) -> None:
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as client:
        response = await client.post(
            "/v1/completions", content=b'{"model": ', headers={"content-type": "application/json"}
        )
    check_error(response, 400, "Bad Request", "JSON decode error")


async def check_metric_names(target: Target) -> None:
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as client:
        families = {f.name: f for f in text_string_to_metric_families(await scrape(client))}
    for name, kind in REQUIRED_METRICS.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
        for sample in families[name].samples:
            assert sample.labels["engine"] == "0" and sample.labels["model_name"] == target.model, sample
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == FINISHED_REASONS, reasons
    assert 0.0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1.0
    # what the picker reads of the cache: its block size and its size in blocks (info labels)
    (info,) = families["vllm:cache_config_info"].samples
    assert info.labels["block_size"].isdigit() and info.labels["num_gpu_blocks"].isdigit(), info.labels


async def _abort_not_counted(client: httpx.AsyncClient, before: str, target: Target) -> None:
    """A client abort is not a finished request for vLLM: success counters and e2e histogram unchanged."""
    after = await scrape(client)
    for reason in FINISHED_REASONS:
        name, labels = "vllm:request_success_total", {"finished_reason": reason, "model_name": target.model}
        assert metric_value(after, name, **labels) == metric_value(before, name, **labels), reason
    name = "vllm:e2e_request_latency_seconds_count"
    assert metric_value(after, name, model_name=target.model) == metric_value(
        before, name, model_name=target.model
    )


async def check_stream_disconnect_aborts(target: Target, long_tokens: int, deadline_s: float = 10.0) -> float:
    """Closing a stream mid-way frees the request (running -> 0); returns seconds until seen."""
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as probe:
        before = await scrape(probe)
        async with http_client.AsyncClient(base_url=target.base_url) as client:
            result = await stream_request(
                client,
                "/v1/completions",
                completion_body(target, long_tokens, True),
                disconnect_after_events=5,
            )
        closed = time.monotonic()
        assert result.end == "disconnected" and result.status == 200, (result.end, result.status)
        assert await wait_until(lambda: _idle(probe, target), deadline_s), "request still running"
        took = time.monotonic() - closed
        await _abort_not_counted(probe, before, target)
    return took


async def _idle(client: httpx.AsyncClient, target: Target) -> bool:
    text = await scrape(client)
    return (
        metric_value(text, "vllm:num_requests_running", model_name=target.model) == 0
        and metric_value(text, "vllm:kv_cache_usage_perc", model_name=target.model) == 0
    )


async def post_on_raw_connection(
    base_url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one POST on a socket of its own and return it unread.

    The disconnect checks drop the connection themselves: cancelling an httpx request task is not
    a disconnect the check controls (a clean-clone CI run saw the cancelled task wait 33 s for the
    whole answer, twice, and vLLM rightly counted the request as finished).
    """
    parts = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    payload = json.dumps(body).encode()
    extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n{extra}\r\n"
    )
    writer.write(head.encode() + payload)
    await writer.drain()
    return reader, writer


async def check_non_streaming_disconnect_aborts(
    target: Target, long_tokens: int, deadline_s: float = 10.0, start_deadline_s: float = 30.0
) -> float:
    async with http_client.AsyncClient(base_url=target.base_url, timeout=30) as probe:
        before = await scrape(probe)
        # A busy vLLM can take seconds to answer /metrics, and an idle one decodes a whole request in
        # that time: an attempt whose request finished before it was seen running proves nothing, and
        # is tried again (its completion counts as "length", so `before` is re-read).
        for _attempt in range(3):
            reader, writer = await post_on_raw_connection(
                target.base_url, "/v1/completions", completion_body(target, long_tokens, False)
            )
            answered = asyncio.create_task(reader.read(1))  # a non-streaming answer: the request ended
            ran = await wait_until(lambda: _running_at_least(probe, target, 1), start_deadline_s, 0.05)
            caught = ran and not answered.done()
            answered.cancel()
            writer.close()  # the client goes away while the server is generating
            await asyncio.gather(answered, writer.wait_closed(), return_exceptions=True)
            if caught:
                break
            await wait_until(lambda: _idle(probe, target), deadline_s)
            before = await scrape(probe)
        assert caught, "the request was never seen running before it finished (3 tries)"
        closed = time.monotonic()
        assert await wait_until(lambda: _idle(probe, target), deadline_s), "request still running"
        took = time.monotonic() - closed
        await _abort_not_counted(probe, before, target)
    return took


async def _running_at_least(client: httpx.AsyncClient, target: Target, count: int) -> bool:
    return await running(client, target) >= count


async def running_is(client: httpx.AsyncClient, target: Target, count: int) -> bool:
    return await running(client, target) == count


async def _flowing_streams(
    target: Target, count: int, tokens: int, read_timeout: float, within_s: float = 30.0
) -> list[asyncio.Task[StreamResult]]:
    """Start `count` streams and return once each has received its first event (client-side proof that
    they are in flight, independent of how fast the server's /metrics answers under load)."""
    flowing = [asyncio.Event() for _ in range(count)]

    async def one(first_event: asyncio.Event) -> StreamResult:
        async with http_client.AsyncClient(base_url=target.base_url) as client:
            body = completion_body(target, tokens, True)
            return await stream_request(
                client, "/v1/completions", body, read_timeout=read_timeout, first_event=first_event
            )

    tasks = [asyncio.create_task(one(event)) for event in flowing]
    try:
        async with asyncio.timeout(within_s):
            await asyncio.gather(*(event.wait() for event in flowing))
    except TimeoutError:
        for task in tasks:
            task.cancel()
        raise AssertionError("streams never started") from None
    assert not any(task.done() for task in tasks), [task.result().end for task in tasks if task.done()]
    return tasks


async def _first_refusal(client: httpx.AsyncClient, target: Target, within_s: float = 20.0) -> httpx.Response:
    """Send tiny completions until one is refused (the drain has begun)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        response = await client.post("/v1/completions", json=completion_body(target, 1, False))
        if response.status_code != 200:
            return response
    raise AssertionError("new completions still accepted after SIGTERM")


async def check_drain_on_sigterm(
    target: Target, stream_tokens: int, streams: int = 2, close_deadline_s: float = 30.0
) -> None:
    """Server started with a shutdown timeout longer than the streams: SIGTERM lets in-flight streams
    finish, refuses new work with vLLM's 500 while /health, /v1/models and /metrics answer 200, then closes
    the listener. Size `stream_tokens` so the streams outlast these probes (a few seconds)."""
    assert target.sigterm is not None, "the drain check needs a way to send SIGTERM"
    tasks = await _flowing_streams(target, streams, stream_tokens, read_timeout=60)
    try:
        # vLLM closes the connection after each drain 500: no keep-alive, one connection per probe.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with http_client.AsyncClient(base_url=target.base_url, timeout=30, limits=limits) as probe:
            target.sigterm()
            check_error(await _first_refusal(probe, target), 500, "InternalServerError", DRAIN_REFUSAL)
            chat = await probe.post("/v1/chat/completions", json=chat_body(target, 1))
            check_error(chat, 500, "InternalServerError", DRAIN_REFUSAL)
            assert (await probe.get("/health")).status_code == 200, "health flips during the drain"
            assert (await probe.get("/v1/models")).status_code == 200
            assert (await probe.get("/metrics")).status_code == 200
            in_flight = sum(not task.done() for task in tasks)
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    for result in results:
        check_finished_stream(result, "text_completion", target, stream_tokens)
    assert in_flight == streams, (
        f"only {in_flight} of {streams} streams outlasted the probes: make them longer"
    )
    assert await wait_until(lambda: port_refuses(target.base_url), close_deadline_s), "listener still open"


def abort_ending(result: StreamResult, stream_tokens: int) -> str:
    """Classify how a stream ended after an abort-mode SIGTERM: "abort", "error" or "hang"."""
    if result.end == "timeout":
        return "hang"
    error = result.error_event
    if error is not None:
        assert ENGINE_ERROR in error["message"] and error["code"] == 500, error
        assert result.done, "error event without [DONE]"
        return "error"
    assert result.finish_reason == "abort" and result.done, (
        result.end,
        result.finish_reason,
        result.raw[-300:],
    )
    usage = result.usage
    assert usage is not None and usage["completion_tokens"] < stream_tokens, usage
    return "abort"


async def check_abort_on_sigterm(
    target: Target,
    stream_tokens: int,
    streams: int = 2,
    refuse_deadline_s: float = 2.0,
    hang_timeout_s: float = 5.0,
) -> list[str]:
    """Server without a shutdown timeout: SIGTERM closes the listener at once; in-flight streams end in one
    of vLLM's three ways (abort + [DONE], error event + [DONE], hang). Returns the endings seen."""
    assert target.sigterm is not None, "the abort check needs a way to send SIGTERM"
    tasks = await _flowing_streams(target, streams, stream_tokens, read_timeout=hang_timeout_s)
    try:
        target.sigterm()
        refused = await wait_until(lambda: port_refuses(target.base_url), refuse_deadline_s)
        assert refused, "listener still open"
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    return [abort_ending(result, stream_tokens) for result in results]
