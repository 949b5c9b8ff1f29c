"""Every endpoint's `GET /v1/models` (scheduling.by_model): the model names it answers to and its
context window, read when the endpoint appears and every `scheduling.models_interval_s` after.

A failed read keeps what was known (a model server does not change its models while it runs; a new
pod is a new endpoint) and is retried at the next tick; an endpoint never read may take any request,
so a model server without `/v1/models` is routed to as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from picker.pool import EndpointState, Pool
from picker.pool.served import parse_models
from picker.sources.cancel import raise_if_cancelled

log = logging.getLogger(__name__)

_TICK_S = 0.5  # how soon a new endpoint is read
_MAX_BYTES = 1024 * 1024


class ModelCards:
    def __init__(
        self,
        pool: Pool,
        interval_s: float,
        timeout_s: float = 2.0,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._on_change = on_change
        self._clock = clock
        self._read_at: dict[str, float] = {}
        self._warned: set[str] = set()
        self._session: aiohttp.ClientSession | None = None

    async def run(self) -> None:
        """Forever (cancel to stop)."""
        while True:
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            await self.read_due()
            await asyncio.sleep(_TICK_S)  # the poll's period, not a synchronisation

    async def read_due(self) -> None:
        now = self._clock()
        due = [
            e.address
            for e in self._pool.endpoints()
            if e.state is not EndpointState.GONE
            and (e.served is None or now - self._read_at.get(e.address, -1e18) >= self._interval_s)
            and now - self._read_at.get(e.address, -1e18) >= _TICK_S
        ]
        if due:
            changed = await asyncio.gather(*(self._read(address) for address in due))
            if any(changed):
                self._on_change()  # a queued request may fit somewhere now

    async def _read(self, address: str) -> bool:
        self._read_at[address] = self._clock()
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self._timeout_s), trust_env=False
            )
        try:
            async with self._session.get(f"http://{address}/v1/models") as response:
                raw = await response.content.read(_MAX_BYTES)
                served = parse_models(json.loads(raw)) if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            served = None
            detail = f"{type(exc).__name__}: {exc}"
        else:
            detail = f"HTTP {response.status}" if served is None else ""
        endpoint = self._pool.get(address)
        if served is None:
            if address not in self._warned:
                self._warned.add(address)
                log.warning("GET /v1/models endpoint=%s: %s; it may take any request", address, detail)
            return False
        if endpoint is None or endpoint.served == served:
            return False
        endpoint.served = served
        log.info(
            "endpoint serves address=%s models=%s max_model_len=%s",
            address,
            ",".join(sorted(served.models)),
            served.max_model_len,
        )
        return True

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
