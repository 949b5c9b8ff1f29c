"""What a real vLLM 0.32 (CPU build) does, checked live: the behaviour the picker and the simulator rely on.

The shared checks come from tests/sim/parity_checks.py and run unchanged against the simulator's tests,
so where the two disagree the simulator is wrong. The checks here are the ones parity_checks lacks.
Facts first measured in /work/shared/reference/vllm-measured.md.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from loadtest.realvllm import launcher
from loadtest.sse_client import StreamResult, stream_request
from tests.sim import parity_checks as pc

# Fixture setup (a vLLM start: 23-26 s idle, much more on a busy box) counts against the timeout.
pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

# Nearly the longest request --max-model-len 16384 allows (> 15 s of engine decoding on an idle box,
# where 8000 tokens sometimes finished before a check could act): outlives every disconnect
# check, which abort it early.
ABORTED_STREAM_TOKENS = 16000
# The drained streams must outlast the drain checks (a few seconds of requests) yet finish well inside
# --shutdown-timeout. The engine's speed varies several-fold with what else runs on the box, so the
# stream length is sized from its measured speed: DRAIN_DECODE_S of decoding at the rate the engine
# showed with DRAINED_STREAMS concurrent requests (the probe's HTTP overhead makes that rate an
# underestimate: the real decoding is somewhat shorter), within the model's context.
DRAINED_STREAMS = 4
DRAIN_DECODE_S = 60.0
DRAIN_PROBE_TOKENS = 400
DRAIN_TIMEOUT_S = 240  # 4x the planned decoding: a slower engine still finishes every stream
# vLLM frees a disconnected request within one engine step (measured < 0.4 s); the bound is generous
# because /metrics itself can take seconds on a loaded 2-core box. A request that ran to completion
# instead of being aborted is caught by the counters (it would count as finished_reason="length").
ABORT_DEADLINE_S = 30.0


def target_of(server: launcher.RealVllm) -> pc.Target:
    return pc.Target(server.url, model=server.model, sigterm=server.terminate)


class TestServing:
    """Checks that leave the server healthy, so they share one vLLM start."""

    async def test_health_and_models(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_health_and_models(target_of(vllm_server))

    async def test_sse_format_completion_and_chat(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_sse_format(target_of(vllm_server), max_tokens=24)

    async def test_non_streaming(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_non_streaming(target_of(vllm_server))

    async def test_unknown_model_is_404(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_unknown_model_404(target_of(vllm_server))

    async def test_malformed_json_is_400(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_malformed_json_400(target_of(vllm_server))

    async def test_metric_names_and_labels(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_metric_names(target_of(vllm_server))

    async def test_counters_follow_a_finished_request(self, vllm_server: launcher.RealVllm) -> None:
        """The counters a proxy reads move by exactly what the response's usage reports."""
        model = vllm_server.model
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
            before = await pc.scrape(client)
            target = target_of(vllm_server)
            response = await client.post("/v1/completions", json=pc.completion_body(target, 12, False))
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            expected_growth = {
                ("vllm:request_success_total", "length"): 1,
                ("vllm:prompt_tokens_total", None): usage["prompt_tokens"],
                ("vllm:generation_tokens_total", None): usage["completion_tokens"],
                ("vllm:e2e_request_latency_seconds_count", None): 1,
                ("vllm:time_to_first_token_seconds_count", None): 1,
            }

            def growth(after: str, name: str, reason: str | None) -> float:
                labels = {"model_name": model} | ({"finished_reason": reason} if reason else {})
                return pc.metric_value(after, name, **labels) - pc.metric_value(before, name, **labels)

            async def counters_caught_up() -> bool:
                after = await pc.scrape(client)
                return all(growth(after, *key) == grown for key, grown in expected_growth.items())

            assert await pc.wait_until(counters_caught_up, within_s=30, interval=0.1)

    async def test_non_streaming_disconnect_aborts(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_non_streaming_disconnect_aborts(
            target_of(vllm_server), ABORTED_STREAM_TOKENS, deadline_s=ABORT_DEADLINE_S
        )

    async def test_stream_disconnect_aborts(self, vllm_server: launcher.RealVllm) -> None:
        await pc.check_stream_disconnect_aborts(
            target_of(vllm_server), ABORTED_STREAM_TOKENS, deadline_s=ABORT_DEADLINE_S
        )

    async def test_sigterm_without_timeout_aborts(self, vllm_server: launcher.RealVllm) -> None:
        """Default shutdown (no --shutdown-timeout): listener closes at once, streams end in one of
        vLLM's three ways. Keep this the LAST test of the class: it ends the shared server (a vLLM
        start of its own would cost ~25 s)."""
        endings = await pc.check_abort_on_sigterm(target_of(vllm_server), ABORTED_STREAM_TOKENS)
        assert set(endings) <= {"abort", "error", "hang"}, endings
        exit_code = await asyncio.to_thread(vllm_server.wait_exit, 30)
        assert exit_code is not None, f"still running after an abort-mode SIGTERM:\n{vllm_server.log_tail()}"


async def raw_refusal_then_close(url: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    """POST on a raw socket; returns (status, headers, what the server sent after the body).

    Bypasses httpx's pool so the check sees exactly what vLLM does with the connection afterwards.
    """
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        writer.write(request)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        status_line, *header_lines = head.decode("latin-1").strip().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
        after_body = await asyncio.wait_for(reader.read(1024), 30)  # b"" once the server closes
        return int(status_line.split()[1]), headers, after_body
    finally:
        writer.close()


async def post_on_new_connection(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """One request on a connection of its own: vLLM drops the connection of a drain-time 500."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.post(path, json=body)


async def get_on_new_connection(url: str, path: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await client.get(path)


async def first_refusal(target: pc.Target, within_s: float = 30.0, attempts: int = 500) -> httpx.Response:
    """Send tiny completions until one is refused (the drain has begun)."""
    deadline = time.monotonic() + within_s
    for _ in range(attempts):
        if time.monotonic() > deadline:
            break
        body = pc.completion_body(target, 1, False)
        response = await post_on_new_connection(target.base_url, "/v1/completions", body)
        if response.status_code != 200:
            return response
    raise AssertionError("new completions still accepted after SIGTERM")


async def drained_stream_tokens(target: pc.Target) -> int:
    """Tokens per drained stream for DRAIN_DECODE_S of decoding at this engine's measured speed."""
    body = pc.completion_body(target, DRAIN_PROBE_TOKENS, False)
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=target.base_url, timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(DRAINED_STREAMS))
        )
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses]
    per_stream_rate = DRAIN_PROBE_TOKENS / elapsed
    return max(DRAIN_PROBE_TOKENS, min(ABORTED_STREAM_TOKENS, int(per_stream_rate * DRAIN_DECODE_S)))


async def stream_to_the_end(target: pc.Target, tokens: int, first_event: asyncio.Event) -> StreamResult:
    async with httpx.AsyncClient(base_url=target.base_url) as client:
        body = pc.completion_body(target, tokens, True)
        return await stream_request(client, "/v1/completions", body, read_timeout=60, first_event=first_event)


async def test_sigterm_drain(vllm_workdir: Path) -> None:
    """With --shutdown-timeout: in-flight streams finish, new work gets vLLM's 500 while /health stays
    200, then the listener closes and the process exits.

    Not pc.check_drain_on_sigterm: after the drain-time 500 vLLM closes that connection without sending
    `Connection: close`, so that check's next request on the same keep-alive connection fails with a
    ReadError whenever it beats the FIN (2 runs of 3 here). Every request after SIGTERM here gets a
    connection of its own, and the close itself is pinned on a raw socket.
    """
    port = launcher.free_port()
    with launcher.real_vllm(port, vllm_workdir, shutdown_timeout=DRAIN_TIMEOUT_S) as server:
        target = target_of(server)
        tokens = await drained_stream_tokens(target)
        # Four long streams share the engine, so the drain outlasts the checks below even on an idle box.
        first_events = [asyncio.Event() for _ in range(DRAINED_STREAMS)]
        streams = [
            asyncio.create_task(stream_to_the_end(target, tokens, first_event))
            for first_event in first_events
        ]
        try:
            # A first token in each: the engine has thousands of tokens left to generate.
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in first_events)), 60)
            assert not any(stream.done() for stream in streams), [s.result().end for s in streams if s.done()]
            server.terminate()

            refusal = await first_refusal(target)
            pc.check_error(refusal, 500, "InternalServerError", pc.DRAIN_REFUSAL)
            assert not all(stream.done() for stream in streams), "the 500 came while streams were in flight"
            chat = await post_on_new_connection(server.url, "/v1/chat/completions", pc.chat_body(target, 1))
            pc.check_error(chat, 500, "InternalServerError", pc.DRAIN_REFUSAL)
            body = httpx.Request("POST", server.url, json=pc.completion_body(target, 1, False)).content
            status, headers, after_body = await raw_refusal_then_close(server.url, body)
            assert status == 500, (status, headers)
            assert headers.get("connection", "").lower() != "close", headers
            assert after_body == b"", "the connection of a drain-time 500 is closed right after it"
            # Draining, yet advertised healthy: a health check alone does not see the drain.
            assert (await get_on_new_connection(server.url, "/health")).status_code == 200
            assert (await get_on_new_connection(server.url, "/v1/models")).status_code == 200
            assert (await get_on_new_connection(server.url, "/metrics")).status_code == 200
            assert not all(stream.done() for stream in streams), "streams in flight during the checks"
            results = await asyncio.gather(*streams)
        finally:
            for stream in streams:
                stream.cancel()
        for result in results:
            pc.check_finished_stream(result, "text_completion", target, tokens)

        assert await pc.wait_until(lambda: pc.port_refuses(server.url), 30, 0.1), "listener still open"
        exit_code = await asyncio.to_thread(server.wait_exit, 30)
        assert exit_code == 0, f"exit code {exit_code} after the drain:\n{server.log_tail()}"
