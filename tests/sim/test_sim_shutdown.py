"""Shutdown like vLLM 0.32, one replica of several, triggered through POST /sim/shutdown.

(SIGTERM of the whole process: test_sim_process.py.)
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import parity_checks as pc
import pytest
from simkit import fast_config, sim_requests
from vllm_sim import AbortStyle, CapacityConfig, Replica, ShutdownConfig, run_sim

from loadtest import http_client
from loadtest.sse_client import StreamResult, stream_request

STOP_WITHIN_S = 5.0
DRAIN_BODY = {
    "error": {
        "message": "cannot schedule new futures after shutdown",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
}


def stream_body(tokens: int) -> dict[str, Any]:
    return {
        "prompt": "x",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def start_streams(
    replica: Replica, count: int, tokens: int, read_timeout: float = 10.0
) -> list[asyncio.Task[StreamResult]]:
    async def one(index: int) -> StreamResult:
        async with http_client.AsyncClient(base_url=replica.url) as http:
            headers = {"x-request-id": f"s{index}"}
            return await stream_request(
                http, "/v1/completions", stream_body(tokens), headers=headers, read_timeout=read_timeout
            )

    return [asyncio.create_task(one(index)) for index in range(count)]


async def admin_shutdown(replica: Replica, **body: Any) -> httpx.Response:
    async with http_client.AsyncClient(base_url=replica.url) as http:
        return await http.post("/sim/shutdown", json=body)


async def test_drain_one_replica_while_the_other_serves() -> None:
    config = fast_config(
        capacity=CapacityConfig(max_num_seqs=1), shutdown=ShutdownConfig(post_drain_close_s=0.05)
    )
    async with run_sim(config, ports=[0, 0]) as (draining, serving):
        streams = start_streams(draining, 2, tokens=60)  # one running, one queued
        assert await pc.wait_until(lambda: len(draining.state.engine.waiting) == 1, 5)
        response = await admin_shutdown(draining, timeout=30)
        assert response.status_code == 202
        assert (await admin_shutdown(draining, timeout=30)).status_code == 409
        async with http_client.AsyncClient(base_url=draining.url) as probe:
            refused = await probe.post("/v1/completions", json={"prompt": "x"})
            assert refused.status_code == 500 and refused.json() == DRAIN_BODY
            chat = await probe.post(
                "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
            )
            assert chat.status_code == 500 and chat.json() == DRAIN_BODY
            assert (await probe.get("/health")).status_code == 200
            assert (await probe.get("/v1/models")).status_code == 200
            assert pc.metric_value(await pc.scrape(probe), "sim_draining") == 1
        async with http_client.AsyncClient(base_url=serving.url) as other:
            assert (
                await other.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            ).status_code == 200
        for result in await asyncio.gather(*streams):
            pc.check_finished_stream(result, "text_completion", pc.Target(draining.url), 60)
        assert await pc.wait_until(lambda: pc.port_refuses(draining.url), STOP_WITHIN_S)
        await asyncio.wait_for(draining.wait_stopped(), STOP_WITHIN_S)
        assert not serving.stopped and not await pc.port_refuses(serving.url)
        assert [e["outcome"] for e in draining.state.log.snapshot() if e["request_id"] in {"s0", "s1"}] == [
            "completed"
        ] * 2


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_abort_mode_ends_running_and_queued_streams_with_finish_reason_abort(endpoint: str) -> None:
    config = fast_config(capacity=CapacityConfig(max_num_seqs=1))
    async with run_sim(config) as (replica,):
        body = stream_body(2000)
        if endpoint.endswith("chat/completions"):
            body = {**body, "messages": [{"role": "user", "content": "x"}]}
        async with (
            http_client.AsyncClient(base_url=replica.url) as first,
            http_client.AsyncClient(base_url=replica.url) as second,
        ):
            tasks = [asyncio.create_task(stream_request(http, endpoint, body)) for http in (first, second)]
            assert await pc.wait_until(lambda: len(replica.state.engine.waiting) == 1, 5)
            assert replica.begin_shutdown()
            assert await pc.wait_until(lambda: pc.port_refuses(replica.url), 1.0)
            running, queued = await asyncio.gather(*tasks)
        for result in (running, queued):
            assert result.end == "done" and result.finish_reason == "abort", result.raw[-300:]
            assert result.usage is not None and result.usage["completion_tokens"] < 2000
        assert queued.usage is not None and queued.usage["completion_tokens"] == 0
        if endpoint.endswith("chat/completions"):
            assert queued.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)
        outcomes = {e["outcome"] for e in replica.state.log.snapshot()}
        assert outcomes == {"shutdown-abort"}
        assert replica.state.stats.success["abort"] == 2


async def test_abort_mode_error_style() -> None:
    config = fast_config(shutdown=ShutdownConfig(abort_style=AbortStyle.ERROR))
    async with run_sim(config) as (replica,):
        (task,) = start_streams(replica, 1, tokens=2000)
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        assert (await admin_shutdown(replica)).status_code == 202
        result = await task
        assert pc.abort_ending(result, 2000) == "error"
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)


async def test_abort_mode_hang_style_holds_the_connection_until_the_client_leaves() -> None:
    config = fast_config(shutdown=ShutdownConfig(abort_style=AbortStyle.HANG))
    async with run_sim(config) as (replica,):
        (task,) = start_streams(replica, 1, tokens=2000, read_timeout=0.5)
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        replica.begin_shutdown()
        assert await pc.wait_until(lambda: pc.port_refuses(replica.url), 1.0)
        result = await task
        assert result.end == "timeout" and not result.done and result.finish_reason is None
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)
        (entry,) = replica.state.log.snapshot()
        assert entry["outcome"] == "hung"


async def test_hang_limit_closes_a_hung_connection() -> None:
    config = fast_config(shutdown=ShutdownConfig(abort_style=AbortStyle.HANG, hang_limit_s=0.2))
    async with run_sim(config) as (replica,):
        (task,) = start_streams(replica, 1, tokens=2000, read_timeout=10)
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        replica.begin_shutdown()
        result = await task
        assert result.end == "error" and not result.done  # closed mid-body: an incomplete chunked read
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)


@pytest.mark.parametrize(("action", "expected"), [("hang", "timeout"), ("abort", "done")])
async def test_drain_timeout_leaves_streams_hanging_or_aborts_them(action: str, expected: str) -> None:
    async with run_sim(fast_config()) as (replica,):
        (task,) = start_streams(replica, 1, tokens=2000, read_timeout=0.5)
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        response = await admin_shutdown(replica, timeout=0.2, on_drain_timeout=action)
        assert response.status_code == 202
        result = await task
        assert result.end == expected
        assert await pc.port_refuses(replica.url)
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)
        (entry,) = replica.state.log.snapshot()
        assert entry["outcome"] == ("hung" if action == "hang" else "shutdown-abort")
        if action == "abort":
            assert result.finish_reason == "abort"


async def test_abort_mode_non_streaming_answers_with_finish_reason_abort() -> None:
    async with (
        run_sim(fast_config()) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=10) as http,
    ):
        request = asyncio.create_task(
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2000, "ignore_eos": True})
        )
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        replica.begin_shutdown()
        response = await request
        assert response.status_code == 200
        assert response.json()["choices"][0]["finish_reason"] == "abort"
        assert response.json()["usage"]["completion_tokens"] < 2000


async def test_force_shutdown_stops_at_once() -> None:
    async with run_sim(fast_config()) as (replica,):
        (task,) = start_streams(replica, 1, tokens=2000)
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        assert (await admin_shutdown(replica, force=True)).status_code == 202
        await asyncio.wait_for(replica.wait_stopped(), STOP_WITHIN_S)
        result = await task
        assert result.end in {"error", "eof"} and not result.done
        assert [e["outcome"] for e in replica.state.log.snapshot()] == ["killed"]


@pytest.mark.parametrize("body", [{"timeout": "soon"}, {"timeout": -1}, {"on_drain_timeout": "explode"}])
async def test_bad_shutdown_calls_are_400(client: httpx.AsyncClient, body: dict[str, Any]) -> None:
    response = await client.post("/sim/shutdown", json=body)
    assert response.status_code == 400


async def test_request_log_lists_the_refused_requests(sim: Replica) -> None:
    sim.begin_shutdown(timeout_s=30)
    async with http_client.AsyncClient(base_url=sim.url) as http:
        await http.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "late"})
    (entry,) = await sim_requests(sim.url, "late")
    assert entry["outcome"] == "shutdown-500" and entry["status"] == 500
