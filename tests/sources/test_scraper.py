"""The load scraper against /metrics pages that are slow, down, huge or garbage (an in-process server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from picker.config.model import LoadConfig
from picker.pool import Pool
from picker.scheduling import LoadPolicy, saturated
from picker.sources.scraper import Scraper
from picker.sources.vllm_metrics import MetricsPageError, parse_engine_gauges

GOOD = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="1.0",model_name="m"} 4.0
"""


def test_gauges_are_summed_over_engines_and_kv_is_the_fullest() -> None:
    gauges = parse_engine_gauges(GOOD)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (4.0, 2.0, 0.5)


@pytest.mark.parametrize(
    "page",
    [
        b"<html><body>502 Bad Gateway</body></html>",
        GOOD.replace(b"} 0.25", b"} NaN"),
        GOOD.replace(b"} 2.0", b"} -1"),
        GOOD.replace(b"} 0.5", b"} 7"),
        GOOD.replace(b"vllm:num_requests_waiting{", b"vllm:other{"),
        GOOD.replace(b"} 3.0", b"} three"),
        b"\xff\xfe" * 100,
        b"",
    ],
)
def test_odd_pages_are_errors_not_idle_engines(page: bytes) -> None:
    with pytest.raises(MetricsPageError):
        parse_engine_gauges(page)


class FakeEngine:
    """A /metrics endpoint whose answer a test chooses."""

    def __init__(self) -> None:
        self.mode = "good"
        self.hits = 0

    async def metrics(self, _: web.Request) -> web.StreamResponse:
        self.hits += 1
        match self.mode:
            case "good":
                return web.Response(body=GOOD)
            case "html":
                return web.Response(body=b"<html>oops</html>", content_type="text/html")
            case "nan":
                return web.Response(body=GOOD.replace(b"} 0.25", b"} NaN"))
            case "huge":
                return web.Response(body=GOOD + b"# filler\n" * 200_000)
            case "slow":
                await asyncio.sleep(1.0)
                return web.Response(body=GOOD)
            case "500":
                return web.Response(status=500, body=b"error")
        raise AssertionError(self.mode)


@pytest.fixture
async def engine() -> AsyncIterator[tuple[FakeEngine, str]]:
    fake = FakeEngine()
    app = web.Application()
    app.router.add_get("/metrics", fake.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


CONFIG = LoadConfig(
    scrape_timeout_s=0.3, max_page_bytes=1024 * 1024, scrape_interval_s=0.05, max_backoff_s=0.4
)


@pytest.mark.parametrize("mode", ["html", "nan", "huge", "slow", "500"])
async def test_bad_metrics_mark_the_endpoint_saturated_and_are_counted(
    engine: tuple[FakeEngine, str], mode: str
) -> None:
    fake, address = engine
    pool = Pool()
    pool.apply(ready=[address])
    failures: list[tuple[str, str]] = []
    rounds: list[int] = []
    scraper = Scraper(
        pool,
        CONFIG,
        on_round=lambda: rounds.append(1),
        on_failure=lambda endpoint, kind: failures.append((endpoint, kind)),
    )
    try:
        await scraper.scrape_round()
        endpoint = pool.get(address)
        assert endpoint is not None and endpoint.load is not None  # a good first scrape
        assert not saturated(endpoint, endpoint.load.at, LoadPolicy(waiting_threshold=10))
        fake.mode = mode
        await scraper.scrape_round()
        assert endpoint.load is None and endpoint.scrape_failures == 1
        assert saturated(endpoint, 0.0, LoadPolicy())
        assert failures == [(address, failures[0][1])] and rounds == [1, 1]
        fake.mode = "good"
        await scraper.scrape_round()  # the first failure is retried on the next round
        assert endpoint.load is not None and endpoint.scrape_failures == 0
    finally:
        await scraper.close()


async def test_repeated_failures_back_off(engine: tuple[FakeEngine, str]) -> None:
    fake, address = engine
    fake.mode = "500"
    pool = Pool()
    pool.apply(ready=[address])
    now = [0.0]
    scraper = Scraper(pool, CONFIG, on_round=lambda: None, clock=lambda: now[0])
    try:
        for _ in range(4):
            await scraper.scrape_round()
            now[0] += 0.01  # far less than the backoff
        assert fake.hits == 2  # failure 1 retried at once; failure 2 waits
        now[0] += CONFIG.max_backoff_s
        await scraper.scrape_round()
        assert fake.hits == 3
    finally:
        await scraper.close()
