"""Saturation, queueing, the status contract and the picker's own shutdown, through the real Envoy."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Result, completion_body, stream_one

pytestmark = pytest.mark.envoy


def busy_stack(
    tmp: Path,
    *,
    slots: int,
    engine_queue: int,
    replicas: int,
    picker_args: tuple[str, ...] = (),
    itl_ms: int = 25,
) -> Stack:
    """Replicas with `slots` running slots and an engine queue of `engine_queue`; the picker knows both."""
    sim_args = (
        "--ttft-ms",
        "10",
        "--itl-ms",
        str(itl_ms),
        "--max-num-seqs",
        str(slots),
        "--max-num-queued-reqs",
        str(engine_queue),
    )
    args = (
        "--engine-slots",
        str(slots),
        "--waiting-threshold",
        str(engine_queue),
        "--scrape-interval",
        "0.05",
        *picker_args,
    )
    return Stack(tmp, StackOptions(replicas=replicas, sim_args=sim_args, picker_args=args)).start()


@pytest.fixture
def saturated_stack(tmp_path: Path) -> Iterator[Stack]:
    stack = busy_stack(tmp_path, slots=2, engine_queue=1, replicas=3)
    try:
        yield stack
    finally:
        stack.stop()


async def test_saturation_queues_in_the_picker_not_on_the_engines(saturated_stack: Stack) -> None:
    stack = saturated_stack
    await asyncio.to_thread(
        wait_until,
        lambda: stack.picker_value("picker_endpoint_engine_running", endpoint=stack.replicas[0]) == 0,
        10,
    )
    async with http_client.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=40)) as client:
        results = await asyncio.gather(
            *(stream_one(client, stack.url, completion_body(20)) for _ in range(24))
        )
    assert [r for r in results if not r.ok] == []
    # 3 replicas x (2 running + 1 engine queue) = 9 at a time: the other 15 waited in the picker ...
    waited = stack.picker_value("picker_flow_wait_seconds_count", outcome="dispatched")
    not_waiting = stack.picker_value("picker_flow_wait_seconds_bucket", outcome="dispatched", le="0.001")
    assert waited == 24 and waited - not_waiting >= 10
    # ... and no engine ever refused a request for a full queue
    assert stack.sim_value("sim_requests_rejected_total") == 0
    stack.wait_no_leaks()


async def hold(
    client: httpx.AsyncClient, stack: Stack, count: int, tokens: int = 200
) -> list[asyncio.Task[Result]]:
    """Start `count` long streams and wait until the picker has them all in flight."""
    tasks = [
        asyncio.create_task(stream_one(client, stack.url, completion_body(tokens))) for _ in range(count)
    ]
    await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == count, 10)
    return tasks


async def test_shutdown_evicts_queued_with_503_and_lets_streams_finish(tmp_path: Path) -> None:
    stack = busy_stack(
        tmp_path,
        slots=4,
        engine_queue=1,
        replicas=2,
        itl_ms=20,
        picker_args=("--drain-timeout", "20", "--propagation", "2"),
    )
    try:
        assert stack.picker is not None
        async with http_client.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=40)) as client:
            streams = await hold(client, stack, 10, tokens=100)  # 2 s each
            queued = [
                asyncio.create_task(stream_one(client, stack.url, completion_body(5))) for _ in range(20)
            ]
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 20, 10)
            stack.picker.signal(signal.SIGTERM)
            evicted = await asyncio.gather(*queued)
            metrics = stack.picker_metrics()  # still served during the drain phase
            finished = await asyncio.gather(*streams)
        code = await asyncio.to_thread(stack.picker.wait_exit, 25)
        assert code == 0
        assert [(r.status, r.reason_header) for r in evicted] == [(503, "rejected-shutting-down")] * 20
        assert all(int(r.retry_after) >= 1 for r in evicted)
        assert all(r.ok for r in finished), [r for r in finished if not r.ok]
        assert metrics[("picker_requests_total", (("outcome", "rejected-shutting-down"),))] == 20
        summary = next(line for line in stack.picker.log_text().splitlines() if "shutdown done" in line)
        assert "evicted=20" in summary and "cut_at_deadline=0" in summary and "queued_at_start=20" in summary
    finally:
        stack.stop()
