"""Routing by predicted latency through each frontend (issue 43): a pool of two replicas, one three
times slower, with affinity.latency on. The picker learns each replica's speed from what it sees and
sends the slow one little new work; a sheddable request whose SLO no replica can meet gets the
contract's refusal, a critical one goes to the best replica (and sheddable work without an SLO then
gives way to its objective), and a malformed SLO header is a 400. With every slot taken, requests wait
in the picker rather than on an engine, and the one with a TTFT objective goes first."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import StackOptions, parse_metrics
from loadtest.traffic import completion_body, stream_one
from tests.frontends.conftest import FRONTENDS, start_stack

pytestmark = pytest.mark.envoy

REQUESTS, WORKERS = 160, 6
FAST = ("--ttft-ms", "10", "--itl-ms", "10")
SLOW = ("--ttft-ms", "30", "--itl-ms", "30")


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_the_slow_replica_is_learned_and_slo_requests_are_routed_or_refused(
    tmp_path: Path, frontend: str
) -> None:
    options = StackOptions(
        replicas=2,
        sim_args=(),
        replica_args=(FAST, SLOW),
        picker_env={"PICKER_AFFINITY__LATENCY": "true"},
        envoy_picker_tls=False,
    )
    stack = start_stack(frontend, tmp_path, options)
    fast, slow = stack.replicas
    try:
        served: list[str] = []
        async with http_client.AsyncClient(timeout=30) as client:

            async def worker() -> None:
                while len(served) < REQUESTS:  # bounded: REQUESTS in all
                    result = await stream_one(client, stack.url, completion_body(12))
                    assert result.ok, result
                    served.append(result.replica)

            await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(WORKERS))), 120)
            unattainable = {"x-slo-ttft-ms": "1"}
            shed = await stream_one(
                client,
                stack.url,
                completion_body(4),
                {**unattainable, "x-gateway-inference-priority": "-1"},
            )
            critical = await stream_one(client, stack.url, completion_body(4), unattainable)
            # sheddable work without an SLO gives way to the critical request's objective
            gives_way = await stream_one(
                client, stack.url, completion_body(4), {"x-gateway-inference-priority": "-1"}
            )
            attainable = await stream_one(
                client,
                stack.url,
                completion_body(4),
                {"x-llm-d-slo-ttft-ms": "5000", "x-gateway-inference-priority": "-1"},
            )
            malformed = await client.post(
                stack.url + "/v1/completions",
                json=completion_body(4, stream=False),
                headers={"x-slo-tpot-ms": "soon"},
            )
        page = parse_metrics(
            http_client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).text
        )
    finally:
        stack.stop()
    model = {labels: v for (name, labels), v in page.items() if name == "picker_latency_model"}
    later = Counter(served[REQUESTS // 2 :])
    figures = {
        "first_half": dict(Counter(served[: REQUESTS // 2])),
        "second_half": dict(later),
        "model": model,
    }
    # a 3x slower replica, at equal load, gets a third of the work by load alone; learned, far less
    assert later[slow] <= 0.15 * sum(later.values()), figures
    learned = {dict(labels)["endpoint"] for (name, labels) in page if name == "picker_latency_model"}
    # each replica a request was picked for is learned; on a loaded machine the slow one can be
    # judged slow (or busy) before the first burst reaches it, and it then has nothing to show
    assert fast in learned and learned <= {fast, slow}, (learned, figures)
    assert slow in learned or slow not in served, (learned, figures)
    assert shed.status == 429 and shed.reason_header == "rejected-slo-unattainable" and shed.retry_after
    assert critical.ok and critical.replica == fast, critical
    assert gives_way.status == 429 and gives_way.reason_header == "rejected-saturated", gives_way
    assert gives_way.retry_after, gives_way
    assert attainable.ok, attainable
    assert malformed.status_code == 400, malformed.text
    refused = page.get(("picker_slo_requests_total", (("objective", "ttft"), ("result", "refused"))), 0.0)
    missed = page.get(("picker_slo_requests_total", (("objective", "ttft"), ("result", "missed"))), 0.0)
    assert refused == 1 and missed >= 1, page


@pytest.mark.parametrize("frontend", FRONTENDS)
async def test_with_every_slot_taken_the_request_with_an_objective_goes_first(
    tmp_path: Path, frontend: str
) -> None:
    """One replica, one batch slot (known to the picker), a long stream in it. A request without an
    objective arrives, then one with a 2-s TTFT objective: both wait in the picker (none on the
    engine, which would serve them in arrival order), and when the slot frees the one with the
    objective takes it."""
    options = StackOptions(
        replicas=1,
        sim_args=("--ttft-ms", "10", "--itl-ms", "20", "--max-num-seqs", "1"),
        picker_args=("--engine-slots", "1", "--scrape-interval", "0.05"),
        picker_env={"PICKER_AFFINITY__LATENCY": "true"},
        envoy_picker_tls=False,
    )
    stack = start_stack(frontend, tmp_path, options)
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            running = asyncio.Event()
            holder = asyncio.create_task(
                stream_one(client, stack.url, completion_body(2000), first_event=running)
            )
            await asyncio.wait_for(running.wait(), 10)
            order: list[str] = []

            async def one(name: str, headers: dict[str, str]) -> None:
                started = asyncio.Event()
                task = asyncio.create_task(
                    stream_one(client, stack.url, completion_body(10), headers, started)
                )
                await asyncio.wait_for(started.wait(), 20)
                order.append(name)
                assert (await task).ok

            plain = asyncio.create_task(one("plain", {}))
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 1, 10)
            due = asyncio.create_task(one("objective", {"x-slo-ttft-ms": "2000"}))
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 2, 10)
            holder.cancel()  # the client leaves: the engine aborts it, its slot frees
            await asyncio.wait_for(asyncio.gather(plain, due), 30)
        assert order == ["objective", "plain"], order
        await asyncio.to_thread(stack.wait_no_leaks)
    finally:
        stack.stop()
