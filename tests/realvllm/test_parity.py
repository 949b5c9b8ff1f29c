"""What a real vLLM 0.32 (CPU build) does, checked live: the behaviour the picker and the simulator rely on.

The shared checks come from tests/sim/parity_checks.py and run unchanged against the simulator's tests,
so where the two disagree the simulator is wrong. The checks here are the ones parity_checks lacks.
Facts first measured in /work/shared/reference/vllm-measured.md.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest import http_client
from loadtest.realvllm import launcher
from loadtest.sse_client import StreamResult, stream_request
from tests.sim import parity_checks as pc

# Fixture setup (a vLLM start: 23-26 s idle, much more on a busy box) counts against the timeout.
pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

# Nearly the longest request --max-model-len 16384 allows (> 15 s of engine decoding on an idle box,
# where 8000 tokens sometimes finished before a check could act): outlives every disconnect
# check, which abort it early.
ABORTED_STREAM_TOKENS = 16000
# SIGTERM in drain mode with two kinds of request in flight, all decoding at once. The *finishing*
# stream is sized to end inside the drain (DRAIN_DECODE_S of decoding at the speed the engine showed
# on DRAIN_CONCURRENCY concurrent requests; the probe's HTTP overhead makes that an underestimate): it
# must end normally. The *anchors* (ABORTED_STREAM_TOKENS each: 80-100 s of decoding beside one
# another on an idle box) hold the drain open longer than the checks take (a draining engine starves
# this 2-core box enough to stall a connect for 15 s), and are then disconnected by the client, which
# ends the drain.
ANCHORS = 4
DRAIN_CONCURRENCY = ANCHORS + 1
DRAIN_DECODE_S = 15.0
DRAIN_PROBE_TOKENS = 400
DRAIN_TIMEOUT_S = 300  # more than the whole drain: only the client ends the anchors
# Requests after SIGTERM: a starved API server can be slow to accept, so each attempt is bounded and
# retried within the window.
REFUSAL_ATTEMPT_S = 20.0
REFUSAL_WINDOW_S = 60.0
# vLLM frees a disconnected request within one engine step (measured < 0.4 s); the bound is generous
# because /metrics itself can take seconds on a loaded 2-core box. A request that ran to completion
# instead of being aborted is caught by the counters (it would count as finished_reason="length").
ABORT_DEADLINE_S = 30.0


def target_of(server: launcher.RealVllm) -> pc.Target:
    return pc.Target(server.url, model=server.model, sigterm=server.terminate)


# A check that fails on a starved box can leave a 16,000-token request decoding on the shared server
# (a disconnect vLLM did not act on): the next check, or its rerun, must not start beside it (its
# counters would move, its streams would crawl). Each check waits for an idle engine first.
IDLE_WITHIN_S = 180.0  # a leftover request runs < 60 s idle; the check timeout (300 s) covers both


async def engine_requests(server: launcher.RealVllm) -> float | None:
    """Requests the engine holds (running + waiting), or None when /metrics does not answer."""
    try:
        async with http_client.AsyncClient(base_url=server.url, timeout=10) as client:
            text = await pc.scrape(client)
    except (httpx.HTTPError, AssertionError):
        return None
    running = pc.metric_value(text, "vllm:num_requests_running", model_name=server.model)
    return running + pc.metric_value(text, "vllm:num_requests_waiting", model_name=server.model)


async def engine_idle(server: launcher.RealVllm) -> bool:
    return await engine_requests(server) == 0


class TestServing:
    """Checks that leave the server healthy, so they share one vLLM start."""

    @pytest.fixture(autouse=True)
    async def _idle_engine(self, vllm_server: launcher.RealVllm) -> None:
        idle = await pc.wait_until(lambda: engine_idle(vllm_server), IDLE_WITHIN_S, interval=0.5)
        assert idle, f"the shared vLLM still busy after {IDLE_WITHIN_S} s:\n{vllm_server.log_tail()}"

    def test_engine_core_yields_the_shared_core(self, vllm_server: launcher.RealVllm) -> None:
        """The EngineCore's busy-wait runs at the lowest priority, the API server at the normal one."""
        members = dict(launcher.group_members(vllm_server.process.pid))
        engine_cores = [pid for pid, comm in members.items() if comm == launcher.ENGINE_CORE_COMM]
        assert len(engine_cores) == 1, members
        assert os.getpriority(os.PRIO_PROCESS, engine_cores[0]) == launcher.ENGINE_CORE_NICE
        assert os.getpriority(os.PRIO_PROCESS, vllm_server.process.pid) == 0

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
        async with http_client.AsyncClient(base_url=vllm_server.url, timeout=60) as client:
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


async def raw_refusal_then_close(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    """POST on a raw socket; returns (status, headers, what the server sent after the body).

    Bypasses httpx's pool so the check sees exactly what vLLM does with the connection afterwards.
    """
    reader, writer = await pc.post_on_raw_connection(url, "/v1/completions", body)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        status_line, *header_lines = head.decode("latin-1").strip().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
        await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 30)
        after_body = await asyncio.wait_for(reader.read(1024), 30)  # b"" once the server closes
        return int(status_line.split()[1]), headers, after_body
    finally:
        writer.close()


async def post_on_new_connection(
    url: str, path: str, body: dict[str, Any], within_s: float = 30.0
) -> httpx.Response:
    """One request on a connection of its own: vLLM drops the connection of a drain-time 500."""
    async with http_client.AsyncClient(base_url=url, timeout=within_s) as client:
        return await client.post(path, json=body)


async def get_on_new_connection(url: str, path: str) -> httpx.Response:
    async with http_client.AsyncClient(base_url=url, timeout=30) as client:
        return await client.get(path)


async def first_refusal(server: launcher.RealVllm, target: pc.Target) -> httpx.Response:
    """Send tiny completions until one is refused (the drain has begun).

    An attempt that gets no answer (a starved API server slow to accept) is retried; failing that,
    the error names what every attempt saw and carries the server's log tail."""
    deadline = time.monotonic() + REFUSAL_WINDOW_S
    seen: list[str] = []
    while time.monotonic() < deadline:
        body = pc.completion_body(target, 1, False)
        try:
            response = await post_on_new_connection(
                target.base_url, "/v1/completions", body, within_s=REFUSAL_ATTEMPT_S
            )
        except httpx.TransportError as error:
            seen.append(type(error).__name__)
            continue
        if response.status_code != 200:
            return response
        seen.append("200")
    raise AssertionError(
        f"no refusal within {REFUSAL_WINDOW_S} s of SIGTERM; attempts saw {seen[-20:]}\n{server.log_tail()}"
    )


async def drained_stream_tokens(target: pc.Target) -> int:
    """Tokens of the finishing stream: DRAIN_DECODE_S of decoding at this engine's measured speed."""
    body = pc.completion_body(target, DRAIN_PROBE_TOKENS, False)
    started = time.monotonic()
    async with http_client.AsyncClient(base_url=target.base_url, timeout=120) as client:
        responses = await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(DRAIN_CONCURRENCY))
        )
    elapsed = time.monotonic() - started
    assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses]
    per_stream_rate = DRAIN_PROBE_TOKENS / elapsed
    return max(DRAIN_PROBE_TOKENS, min(ABORTED_STREAM_TOKENS // 4, int(per_stream_rate * DRAIN_DECODE_S)))


async def stream_to_the_end(
    target: pc.Target, tokens: int, first_event: asyncio.Event, read_timeout: float | None = 60
) -> StreamResult:
    """A streaming completion read to its end. A queued request's first token can take minutes:
    pass read_timeout=None for those (the caller ends them)."""
    async with http_client.AsyncClient(base_url=target.base_url) as client:
        body = pc.completion_body(target, tokens, True)
        return await stream_request(
            client, "/v1/completions", body, read_timeout=read_timeout, first_event=first_event
        )


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
        started = [asyncio.Event() for _ in range(DRAIN_CONCURRENCY)]
        finishing = asyncio.create_task(stream_to_the_end(target, tokens, started[0]))
        anchors = [
            asyncio.create_task(stream_to_the_end(target, ABORTED_STREAM_TOKENS, event, read_timeout=None))
            for event in started[1:]
        ]
        try:
            # A first token in each: every stream is decoding, with most of its tokens to come.
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), 60)
            assert not finishing.done(), finishing.result().end
            server.terminate()

            refusal = await first_refusal(server, target)
            pc.check_error(refusal, 500, "InternalServerError", pc.DRAIN_REFUSAL)
            # Refused while the drain still runs. The checks below hold after SIGTERM until the listener
            # closes, whether or not a stall of this VM outlasts the anchors meanwhile.
            ended = [a.result().end for a in anchors if a.done()]
            assert len(ended) < ANCHORS, f"new work was refused only after every anchor ended: {ended}"
            # Draining, yet advertised healthy: a health check alone does not see the drain.
            assert (await get_on_new_connection(server.url, "/health")).status_code == 200
            chat = await post_on_new_connection(server.url, "/v1/chat/completions", pc.chat_body(target, 1))
            pc.check_error(chat, 500, "InternalServerError", pc.DRAIN_REFUSAL)
            status, headers, after_body = await raw_refusal_then_close(
                server.url, pc.completion_body(target, 1, False)
            )
            assert status == 500, (status, headers)
            assert headers.get("connection", "").lower() != "close", headers
            assert after_body == b"", "the connection of a drain-time 500 is closed right after it"
            assert (await get_on_new_connection(server.url, "/v1/models")).status_code == 200
            assert (await get_on_new_connection(server.url, "/metrics")).status_code == 200
            result = await finishing
        finally:
            for stream in (finishing, *anchors):
                stream.cancel()  # the anchors' client disconnect: vLLM aborts them and the drain ends
        pc.check_finished_stream(result, "text_completion", target, tokens)

        assert await pc.wait_until(lambda: pc.port_refuses(server.url), 60, 0.1), "listener still open"
        exit_code = await asyncio.to_thread(server.wait_exit, 30)
        assert exit_code == 0, f"exit code {exit_code} after the drain:\n{server.log_tail()}"
