"""Token ids for precise prefix affinity, from an engine's own tokenizer (vLLM's `POST /tokenize`).

The KV events name blocks by their token ids, so a request must be tokenized exactly as the engine
will tokenize it: chat requests through its chat template, completions as they are. The engine
does both (`/tokenize` takes a completions `prompt` or chat `messages` with `tools`); any ready
endpoint serving the model will do, in turn. One pooled aiohttp client; an answer that does not
come within `affinity.tokenize_timeout_s`, or is not a token list, is None: the request is then
placed by load alone (counted, never an error for the client).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import Any

import aiohttp

from picker.pool import Pool

log = logging.getLogger(__name__)


class EngineTokenizer:
    def __init__(self, pool: Pool, timeout_s: float) -> None:
        self._pool = pool
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None
        self._turn = itertools.count()
        self.failures = 0

    async def tokenize(self, model: str, request: Mapping[str, Any]) -> list[int] | None:
        ready = self._pool.ready()
        if not ready:
            return None
        endpoint = ready[next(self._turn) % len(ready)].address
        if self._session is None:  # created on the running loop
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=64), trust_env=False
            )
        try:
            async with self._session.post(
                f"http://{endpoint}/tokenize", json={"model": model, **request}
            ) as response:
                if response.status != 200:
                    raise ValueError(f"HTTP {response.status}")
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            self.failures += 1
            if self.failures == 1 or self.failures % 100 == 0:
                log.warning(
                    "tokenize at %s failed (%s); placing by load (%d failures)", endpoint, exc, self.failures
                )
            return None
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            self.failures += 1
            return None
        return tokens

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
