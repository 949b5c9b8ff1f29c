"""Scrape every endpoint's /metrics on a short interval, with one pooled HTTP client.

The client is aiohttp's: at 100 endpoints x 10 scrapes/s the client's own CPU is most of the cost,
and aiohttp spends about a sixth of what httpx does per request (loadtest/bench_flow.py).
Failures are counted per endpoint and back off exponentially; a failed or stale endpoint counts as
saturated, never as idle. After each round the pipeline is told, so queued requests can go to room
that just appeared. Each endpoint's page is read from its own host, on `load.metrics_port` when
set (like the reference picker's --model-server-metrics-port); https is read without verifying the
model server's certificate, as the reference picker does by default.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from picker.config.model import LoadConfig
from picker.pool import Endpoint, EndpointState, Pool
from picker.pool.scrapes import record_engine_info, record_failure, record_sample
from picker.sources.cancel import raise_if_cancelled
from picker.sources.vllm_metrics import EngineGauges, GaugeScanner, MetricsPageError, gauge_names

log = logging.getLogger(__name__)


_CHUNK_BYTES = 65536  # the most of a page scanned between two turns of the event loop


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
        # each good scrape, before the round settles anything (the books' gap: the wiring's)
        self.on_sample: Callable[[Endpoint], None] | None = None
        self.blind: Callable[[], bool] = lambda: False  # a data plane hides ends (the wiring's)
        self._on_failure = on_failure or (lambda endpoint, kind: None)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._next_due: dict[str, float] = {}
        self._names = gauge_names(config)
        self._urls: dict[str, str] = {}

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
        """Scrape forever on the configured interval (cancel to stop); the shorter one while some
        data plane hides responses' ends (`blind`): the engines' gauges are the books there."""
        while True:
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            started = self._clock()
            await self.scrape_round()
            config = self._config
            every = config.blind_scrape_interval_s if self.blind() else config.scrape_interval_s
            await asyncio.sleep(max(0.0, every - (self._clock() - started)))

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
            self._urls.pop(address, None)
        if due:
            await asyncio.gather(*(self._scrape(address) for address in due))
        self._on_round()

    async def _scrape(self, address: str) -> None:
        known = self._pool.get(address)
        arrivals_before = known.arrivals if known is not None else 0
        peer_arrivals_before = known.peer_arrivals if known is not None else 0
        sent_at = self._clock()
        try:
            gauges = await self._fetch(address)
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
                peer_arrivals_before=peer_arrivals_before,
                sent_at=sent_at,
            )
            if self.on_sample is not None:
                self.on_sample(endpoint)
            adapters = gauges.adapters
            record_engine_info(
                endpoint,
                gauges.block_size,
                gauges.num_blocks,
                (adapters.running, adapters.waiting, adapters.max_lora) if adapters is not None else None,
            )
        self._next_due[address] = 0.0

    async def _fetch(self, address: str) -> EngineGauges:
        """Read and scan the page a chunk at a time, yielding to the loop after each chunk.

        aiohttp hands over buffered chunks without suspending, so without the explicit yield a
        large page that arrived at once would be scanned in one go.
        """
        url = self._urls.get(address) or self._urls.setdefault(address, self._metrics_url(address))
        cap = self._config.max_page_bytes
        scanner = GaugeScanner(self._config.max_gauge_lines, self._names)
        async with self._client().get(url, allow_redirects=False, ssl=False) as response:
            if response.status != 200:
                raise MetricsPageError(f"HTTP {response.status}")
            size = 0
            async for chunk in response.content.iter_chunked(_CHUNK_BYTES):
                size += len(chunk)
                if size > cap:
                    raise _PageTooLarge(f"page over {cap} bytes")
                scanner.feed(chunk)
                await asyncio.sleep(0)
        return scanner.result()

    def _metrics_url(self, address: str) -> str:
        """The endpoint's host, on the metrics port when one is configured (else its serving port)."""
        config = self._config
        host, _, port = address.rpartition(":")
        if config.metrics_port is not None:
            port = str(config.metrics_port)
        return f"{config.metrics_scheme}://{host}:{port}{config.metrics_path}"

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
