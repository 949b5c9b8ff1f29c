"""Whatever a model server's /metrics page holds, the picker's event loop keeps turning.

A 10 ms ticker runs beside the scraper; its longest gap is the longest the loop was blocked. A
page parsed in one go on the loop (4 MiB of gauge lines took 1.4 s) misses the bound by far.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.config.model import LoadConfig
from picker.pool import Pool
from picker.sources.scraper import Scraper
from picker.sources.vllm_metrics import MAX_LINE_BYTES, GaugeScanner, MetricsPageError, parse_engine_gauges
from tests.sources.hostile_metrics import MIB, gauge_flood, page_server
from tests.sources.test_scraper import GOOD

BLOCKED_BOUND_S = 0.5  # the broken scraper blocked for 1.4 s per page on a quiet machine


async def longest_loop_gap(work: asyncio.Future[None] | asyncio.Task[None]) -> float:
    """The longest a 10 ms ticker waited past its due time while `work` ran."""
    gap = 0.0
    while not work.done():
        before = time.perf_counter()
        await asyncio.sleep(0.01)
        gap = max(gap, time.perf_counter() - before - 0.01)
    await work
    return gap


async def scrape_rounds(page: bytes, rounds: int) -> tuple[Pool, str, list[str], float]:
    with page_server(page) as server:
        pool = Pool()
        pool.apply(ready=[server.address])
        failures: list[str] = []
        now = [0.0]
        scraper = Scraper(
            pool,
            LoadConfig(scrape_timeout_s=30.0, max_page_bytes=4 * MIB),
            on_round=lambda: None,
            on_failure=lambda _, kind: failures.append(kind),
            clock=lambda: now[0],
        )

        async def run() -> None:
            for _ in range(rounds):
                await scraper.scrape_round()
                now[0] += 3600.0  # always due again, whatever the backoff

        try:
            gap = await longest_loop_gap(asyncio.ensure_future(run()))
        finally:
            await scraper.close()
        assert server.requests == rounds
        return pool, server.address, failures, gap


async def test_a_page_of_4_mib_of_gauge_lines_does_not_block_the_loop() -> None:
    page = gauge_flood(4 * MIB - 1024)
    pool, address, failures, gap = await scrape_rounds(page, rounds=3)
    assert gap < BLOCKED_BOUND_S, f"the event loop was blocked for {gap:.3f} s"
    endpoint = pool.get(address)
    assert endpoint is not None and endpoint.load is None  # too many gauge lines: saturated, not idle
    assert failures == ["MetricsPageError"] * 3


async def test_a_4_mib_page_of_other_lines_is_read_without_blocking_the_loop() -> None:
    filler = b'vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0\n'
    page = filler * (2 * MIB // len(filler)) + GOOD + filler * (2 * MIB // len(filler) - 100)
    pool, address, failures, gap = await scrape_rounds(page, rounds=3)
    assert gap < BLOCKED_BOUND_S, f"the event loop was blocked for {gap:.3f} s"
    endpoint = pool.get(address)
    assert failures == [] and endpoint is not None and endpoint.load is not None
    assert (endpoint.load.running, endpoint.load.waiting, endpoint.load.kv_usage) == (4.0, 2.0, 0.5)


def test_gauge_lines_are_bounded_in_number_and_length() -> None:
    with pytest.raises(MetricsPageError, match="more than 100 gauge lines"):
        parse_engine_gauges(gauge_flood(64 * 1024), max_lines=100)
    long_line = b'vllm:num_requests_running{engine="' + b"x" * MAX_LINE_BYTES + b'"} 1\n'
    with pytest.raises(MetricsPageError, match="over"):
        parse_engine_gauges(long_line + GOOD)
    scanner = GaugeScanner(max_lines=256)
    with pytest.raises(MetricsPageError, match="over"):  # the same line arriving in pieces
        for offset in range(0, len(long_line), 1000):
            scanner.feed(long_line[offset : offset + 1000])
    # A gauge name inside another line is not a gauge line.
    inside = b'vllm:other{note="vllm:num_requests_running{"} 5\n# x vllm:num_requests_waiting 7\n'
    assert parse_engine_gauges(inside + GOOD) == parse_engine_gauges(GOOD)
    # An endless non-gauge line is skipped without being kept, and the page still reads.
    scanner = GaugeScanner(max_lines=256)
    scanner.feed(b"# comment " + b"y" * 1000)
    for _ in range(100):
        scanner.feed(b"y" * 1000)
    scanner.feed(b"\n" + GOOD)
    assert scanner.result() == parse_engine_gauges(GOOD)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(GOOD)), max_size=12))
def test_a_page_reads_the_same_however_it_is_split_into_chunks(cuts: list[int]) -> None:
    scanner = GaugeScanner(max_lines=256)
    bounds = [0, *sorted(cuts), len(GOOD)]
    for start, end in itertools.pairwise(bounds):
        scanner.feed(GOOD[start:end])
    assert scanner.result() == parse_engine_gauges(GOOD)
