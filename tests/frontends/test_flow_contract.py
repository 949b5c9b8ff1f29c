"""The admission queue's answers through both frontends: 429 with reason, Retry-After and JSON body
when the queue is full or a request waited past its TTL, and a queued client that leaves gives up its
place at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Result, completion_body, stream_one
from tests.frontends.conftest import FRONTENDS, start_stack

pytestmark = pytest.mark.envoy


def one_slot_stack(frontend: str, tmp: Path) -> Stack:
    """One replica with one running slot and one engine queue place; the picker knows both."""
    sim = ("--ttft-ms", "10", "--itl-ms", "25", "--max-num-seqs", "1", "--max-num-queued-reqs", "1")
    picker = ("--engine-slots", "1", "--waiting-threshold", "1", "--scrape-interval", "0.05")
    picker += ("--queue-ttl", "0.5", "--max-queued", "1")
    return start_stack(frontend, tmp, StackOptions(replicas=1, sim_args=sim, picker_args=picker))


async def hold(client: httpx.AsyncClient, stack: Stack, count: int) -> list[asyncio.Task[Result]]:
    """`count` long streams, all in flight at the picker: the first one running on the engine before
    the next is sent (sent together they raced for the engine's one slot and one queue place, and
    one loaded clean-clone CI run saw in-flight stay below 2 for 10 s; a timeout now says what the
    holders got)."""
    running = asyncio.Event()
    tasks = [asyncio.create_task(stream_one(client, stack.url, completion_body(200), first_event=running))]
    await asyncio.wait_for(running.wait(), 10)
    tasks += [
        asyncio.create_task(stream_one(client, stack.url, completion_body(200))) for _ in range(count - 1)
    ]
    try:
        await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == count, 10)
    except TimeoutError:
        raise AssertionError(f"holders: {[t.result() if t.done() else 'running' for t in tasks]}") from None
    return tasks


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_full_queue_and_ttl_expiry_get_429_with_reason_and_retry_after(
    tmp_path: Path, frontend: str
) -> None:
    stack = one_slot_stack(frontend, tmp_path)
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            holders = await hold(client, stack, 2)  # the engine's slot and its one queue place
            waiting = asyncio.create_task(
                client.post(stack.url + "/v1/completions", json=completion_body(1, stream=False))
            )
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 1, 10)
            full = await client.post(stack.url + "/v1/completions", json=completion_body(1, stream=False))
            expired = await waiting
            for holder in holders:
                holder.cancel()
        assert (full.status_code, full.headers["x-picker-dropped-reason"]) == (429, "rejected-saturated")
        assert (expired.status_code, expired.headers["x-picker-dropped-reason"]) == (
            429,
            "rejected-ttl-expired",
        )
        for response in (full, expired):
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["content-type"] == "application/json"
            assert response.json()["error"]["code"] == 429
        await asyncio.to_thread(stack.wait_no_leaks)
    finally:
        stack.stop()


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_client_gone_while_queued_frees_its_place_at_once(tmp_path: Path, frontend: str) -> None:
    stack = one_slot_stack(frontend, tmp_path)
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            holders = await hold(client, stack, 2)
            queued = asyncio.create_task(stream_one(client, stack.url, completion_body(5)))
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 1, 10)
            queued.cancel()
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 0, 5)
            assert stack.picker_value("picker_requests_total", outcome="rejected-context-cancelled") == 1
            for holder in holders:
                holder.cancel()
        await asyncio.to_thread(stack.wait_no_leaks)
    finally:
        stack.stop()
