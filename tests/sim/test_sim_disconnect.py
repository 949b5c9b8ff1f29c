"""A client that goes away aborts its request: streaming, non-streaming and queued.

The slot must be freed at the disconnect, not when the request would have finished: each request here
would run for 25 s, and the bound (the simulator's own clock, the request log's `end`, against the
moment the client closed) is 10 s, which only an implementation that never notices the disconnect
misses, however slow or busy the machine. Detection is event-driven (handler cancellation): the real
figure is ~1 ms, measured by loadtest/bench_sim.py, not here.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import parity_checks as pc
from simkit import fast_config, sim_requests
from vllm_sim import CapacityConfig, Replica, run_sim

from loadtest import http_client
from loadtest.sse_client import stream_request

LONG = {"prompt": "x", "max_tokens": 5000, "ignore_eos": True}  # 25 s at the fast config's 5 ms ITL
SLOT_FREED_WITHIN_S = 10.0  # far below the 25 s a request that is not aborted would take


async def aborted_entry(replica: Replica, request_id: str) -> dict[str, Any]:
    async def ended() -> bool:
        return (await sim_requests(replica.url, request_id))[0]["outcome"] != "in-flight"

    assert await pc.wait_until(ended, SLOT_FREED_WITHIN_S)
    (entry,) = await sim_requests(replica.url, request_id)
    assert entry["outcome"] == "aborted", entry
    return entry


async def test_stream_disconnect_frees_the_slot_at_once(sim: Replica) -> None:
    async with http_client.AsyncClient(base_url=sim.url) as http:
        result = await stream_request(
            http,
            "/v1/completions",
            {**LONG, "stream": True},
            headers={"x-request-id": "s1"},
            disconnect_after_events=5,
        )
    closed = time.time()
    assert result.end == "disconnected"
    entry = await aborted_entry(sim, "s1")
    assert entry["end"] - closed < SLOT_FREED_WITHIN_S
    assert entry["tokens_sent"] >= 5
    assert not sim.state.engine.running and sim.state.stats.aborted == 1


async def test_non_streaming_disconnect_frees_the_slot_at_once(sim: Replica) -> None:
    _, writer = await pc.post_on_raw_connection(sim.url, "/v1/completions", LONG, {"x-request-id": "n1"})
    assert await pc.wait_until(lambda: len(sim.state.engine.running) == 1, 5)
    writer.close()  # the client goes away before the answer
    await writer.wait_closed()
    closed = time.time()
    entry = await aborted_entry(sim, "n1")
    assert entry["end"] - closed < SLOT_FREED_WITHIN_S
    assert not sim.state.engine.running


async def test_queued_disconnect_leaves_the_queue() -> None:
    config = fast_config(capacity=CapacityConfig(max_num_seqs=1))
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=30) as http,
    ):
        holder = asyncio.create_task(stream_request(http, "/v1/completions", {**LONG, "stream": True}))
        assert await pc.wait_until(lambda: len(replica.state.engine.running) == 1, 5)
        queued = asyncio.create_task(
            stream_request(http, "/v1/completions", {**LONG, "stream": True}, headers={"x-request-id": "q1"})
        )
        assert await pc.wait_until(lambda: len(replica.state.engine.waiting) == 1, 5)
        queued.cancel()
        await asyncio.gather(queued, return_exceptions=True)
        closed = time.time()
        entry = await aborted_entry(replica, "q1")
        assert entry["end"] - closed < SLOT_FREED_WITHIN_S
        assert entry["first_token_at"] is None and not replica.state.engine.waiting
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


async def test_abort_counted_by_sim_counter_not_by_vllm_success(sim: Replica) -> None:
    target = pc.Target(sim.url)
    await pc.check_stream_disconnect_aborts(target, long_tokens=5000, deadline_s=SLOT_FREED_WITHIN_S)
    await pc.check_non_streaming_disconnect_aborts(target, long_tokens=5000, deadline_s=SLOT_FREED_WITHIN_S)
    async with http_client.AsyncClient(base_url=sim.url) as http:
        exposition = await pc.scrape(http)
    assert pc.metric_value(exposition, "sim_requests_aborted_total") == 2
    assert pc.metric_value(exposition, "vllm:request_success_total", finished_reason="abort") == 0
    assert pc.metric_value(exposition, "sim_requests_ended_total", outcome="aborted") == 2
