"""Scrape every endpoint's /metrics on a short interval, with one pooled HTTP client.

The client is aiohttp's: at 100 endpoints x 10 scrapes/s the client's own CPU is most of the cost,
and aiohttp spends about a sixth of what httpx does per request (loadtest/bench_flow.py).
Failures are counted per endpoint and back off exponentially; a failed or stale endpoint counts as
saturated, never as idle. After each round the pipeline is told, so queued requests can go to room
that just appeared.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from picker.config import LoadConfig
from picker.pool import EndpointState, Pool
from picker.pool.load import record_failure, record_sample
from picker.sources.vllm_metrics import MetricsPageError, parse_engine_gauges

log = logging.getLogger(__name__)


class _PageTooLarge(Exception):
    pass


class Scraper:
    def __init__(
        self,
        pool: Pool,
        config: LoadConfig,
        on_round: Callable[[], None],
        on_failure: Callable[[str, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._config = config
        self._on_round = on_round
        self._on_failure = on_failure or (lambda endpoint, kind: None)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._next_due: dict[str, float] = {}

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the running loop, on first use
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._config.scrape_timeout_s),
                connector=aiohttp.TCPConnector(limit=256, limit_per_host=2, ttl_dns_cache=60),
                trust_env=False,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def run(self) -> None:
        """Scrape forever on the configured interval (cancel to stop)."""
        while True:
            started = self._clock()
            await self.scrape_round()
            await asyncio.sleep(max(0.0, self._config.scrape_interval_s - (self._clock() - started)))

    async def scrape_round(self) -> None:
        """One pass over every endpoint that is due."""
        now = self._clock()
        due = [
            e.address
            for e in self._pool.endpoints()
            if e.state is not EndpointState.GONE and self._next_due.get(e.address, 0.0) <= now
        ]
        for address in [a for a in self._next_due if self._pool.get(a) is None]:
            del self._next_due[address]
        if due:
            await asyncio.gather(*(self._scrape(address) for address in due))
        self._on_round()

    async def _scrape(self, address: str) -> None:
        known = self._pool.get(address)
        arrivals_before = known.arrivals if known is not None else 0
        try:
            page = await self._fetch(address)
            gauges = parse_engine_gauges(page)
        except (aiohttp.ClientError, TimeoutError, MetricsPageError, _PageTooLarge, OSError) as exc:
            self._failed(address, type(exc).__name__, str(exc))
            return
        endpoint = self._pool.get(address)
        if endpoint is not None:
            record_sample(
                endpoint,
                gauges.running,
                gauges.waiting,
                gauges.kv_usage,
                self._clock(),
                arrivals_before=arrivals_before,
            )
        self._next_due[address] = 0.0

    async def _fetch(self, address: str) -> bytes:
        url = f"http://{address}{self._config.metrics_path}"
        cap = self._config.max_page_bytes
        async with self._client().get(url, allow_redirects=False) as response:
            if response.status != 200:
                raise MetricsPageError(f"HTTP {response.status}")
            body = bytearray()
            async for chunk in response.content.iter_chunked(65536):
                body += chunk
                if len(body) > cap:
                    raise _PageTooLarge(f"page over {cap} bytes")
            return bytes(body)

    def _failed(self, address: str, kind: str, detail: str) -> None:
        endpoint = self._pool.get(address)
        if endpoint is None:
            return
        record_failure(endpoint)
        failures = endpoint.scrape_failures
        delay = (
            0.0
            if failures <= 1
            else min(self._config.max_backoff_s, self._config.scrape_interval_s * 2 ** (failures - 1))
        )
        self._next_due[address] = self._clock() + delay
        self._on_failure(address, kind)
        if failures == 1 or failures % 50 == 0:
            log.warning(
                "scrape failed endpoint=%s kind=%s failures=%d detail=%.200s", address, kind, failures, detail
            )
