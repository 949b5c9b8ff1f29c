"""Through the real Envoy: hostile input that reaches the picker's metrics.

One replica serving a hostile /metrics page does not stall the picker.

The page is 4 MiB of valid gauge lines (under `load.max_page_bytes`). Parsed whole on the event
loop every scrape, it kept the picker blocked most of the time: requests waited seconds for their
routing answer (or got Envoy's 504) and the admin API took seconds to answer. And a client's huge
model name does not reach the picker's own /metrics whole.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one
from picker.observability.metrics import MAX_LABEL_CHARS
from tests.sources.hostile_metrics import MIB, gauge_flood, page_server

pytestmark = pytest.mark.envoy

REQUESTS = 10
# A short stream takes about 0.1 s here; the broken picker added a stall of 1.4-2.9 s (the time to
# parse the page) to nearly every request: ten of them took 15.5 s.
ALL_REQUESTS_BOUND_S = 6.0


async def test_a_replica_serving_4_mib_of_gauge_lines_does_not_stall_routing(tmp_path: Path) -> None:
    with page_server(gauge_flood(4 * MIB - 1024)) as hostile:
        stack = Stack(tmp_path, StackOptions(replicas=2, extra_envoy_endpoints=[hostile.address]))
        stack.options.picker_endpoints = [*stack.replicas, hostile.address]
        stack.start()
        try:
            await asyncio.to_thread(
                wait_until, lambda: hostile.requests >= 2, 20, what="two scrapes of the hostile page"
            )
            started = time.monotonic()
            async with http_client.AsyncClient(timeout=30) as client:
                results = [await stream_one(client, stack.url, completion_body(3)) for _ in range(REQUESTS)]
                admin = await client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints")
            took = time.monotonic() - started
            assert all(r.ok for r in results), [(r.status, r.reason_header, r.error) for r in results]
            assert {r.replica for r in results} <= set(stack.replicas)  # the hostile one is saturated
            assert admin.status_code == 200
            assert took < ALL_REQUESTS_BOUND_S, f"{REQUESTS} requests and one admin call took {took:.1f} s"
            assert (
                stack.picker_value(
                    "picker_scrape_failures_total", endpoint=hostile.address, kind="MetricsPageError"
                )
                >= 1
            )
            stack.wait_no_leaks()
        finally:
            stack.stop()


async def test_a_2_mib_model_name_does_not_grow_the_pickers_metrics(tmp_path: Path) -> None:
    """The broken picker's /metrics grew from 15 KB to 31 MB. Refused at the door or routed with a
    bounded label (picker/observability/metrics.py), the name never reaches the page whole."""
    huge = "x" * (2 * MIB)
    stack = Stack(tmp_path, StackOptions(replicas=1)).start()
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            for _ in range(2):
                body = {"model": huge, "prompt": "hi", "max_tokens": 2, "stream": True}
                reply = await client.post(stack.url + "/v1/completions", json=body)
                assert reply.status_code in (400, 404)  # bad-request at the door, or the replica's 404
            await asyncio.to_thread(stack.wait_no_leaks)
            page = (await client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics")).text
        assert len(page) < 256 * 1024, f"/metrics is {len(page)} bytes"
        assert "x" * (MAX_LABEL_CHARS + 1) not in page
    finally:
        stack.stop()
