"""The proxy's client to the model servers: pooled keep-alive HTTP/1.1, retried only before the first byte.

An attempt that fails to connect, is reset before its response headers, or is answered 500 or 503
(as the shipped Envoy route's retriable status codes) moves to the next endpoint of the picker's
ordered list; the last endpoint's answer stands. Once a response is
handed back nothing here retries: the caller streams it, and the request body can be dropped.

aiohttp's client, not httpx's: measured on this path (docs, "Without Envoy"), httpcore's pool
checks every pooled connection on every request (a poll() each), which cost ~2 ms per request at 32
concurrent streams; aiohttp's pool hands a connection over in O(1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_none

from picker.config.model import ProxyConfig
from picker.contract import headers as header_names

# Answers before the first byte that move to the next endpoint, as config/envoy.yaml's route retries:
# 503 (busy), 500 (vLLM's drain refusal, and an engine that failed before streaming anything)
_RETRIED_STATUSES = (500, 503)
_REFUSAL_READ_CAP = 64 * 1024  # a 500/503 is read this far to decide; the rest streams on after it
# Connect refused or timed out, reset or closed before the response headers, or a response head
# aiohttp cannot parse (ClientResponseError: a bad status line or header): nothing was streamed yet.
_BEFORE_HEADERS = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientResponseError,
    TimeoutError,
)
# Upstream failures while a body is being read (a reset, a close in the middle of chunked framing).
UPSTREAM_READ_ERRORS = (aiohttp.ClientError, TimeoutError)


@dataclass(slots=True)
class Opened:
    """A response with its headers in: the commit point. `head` holds the body read while deciding."""

    response: aiohttp.ClientResponse
    served: str
    attempts: int
    head: bytes | None = None  # the start of a 500/503's body, read to decide
    complete: bool = False  # `head` is the whole body (else the rest is still to be read)


class UpstreamUnavailable(Exception):
    """Every attempt failed before a response (connect refused, reset, timeout)."""

    def __init__(self, attempts: int, last: str) -> None:
        super().__init__(f"{attempts} upstream attempt(s) failed; last: {last}")
        self.attempts = attempts
        self.last = last


class _TryNext(Exception):
    """This endpoint cannot take the request; the next one may (or the last answer stands)."""

    def __init__(self, why: str, opened: Opened | None = None) -> None:
        super().__init__(why)
        self.opened = opened


class Upstream:
    def __init__(self, config: ProxyConfig) -> None:
        self._config = config
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # created on the running loop
            config = self._config
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=config.max_connections, limit_per_host=0, keepalive_timeout=30.0
                ),
                # connect short (then the next pick); read none: a stream may be quiet for long
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=config.connect_timeout_s,
                    sock_connect=config.connect_timeout_s,
                    sock_read=config.headers_timeout_s,
                ),
                auto_decompress=False,  # bytes pass through as the model server encoded them
                skip_auto_headers=header_names.CLIENT_LIBRARY_DEFAULTS,
                trust_env=False,
            )
        return self._session

    async def open(
        self,
        destinations: Sequence[str],
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Opened:
        """Send along the ordered list until one endpoint answers with something worth streaming."""
        targets = list(destinations[: self._config.max_attempts])
        try:  # the common case first, without building a retry loop per request
            return await self._attempt(targets[0], 1, method, target, headers, body)
        except _TryNext as first:
            if len(targets) == 1:
                return _answer_or_raise(first, 1)
            _discard(first)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(len(targets) - 1),
            retry=retry_if_exception_type(_TryNext),
            wait=wait_none(),
            reraise=True,
            before_sleep=lambda state: _discard(state.outcome.exception() if state.outcome else None),
        )
        try:
            async for attempt in retrying:
                with attempt:
                    number = attempt.retry_state.attempt_number + 1
                    return await self._attempt(targets[number - 1], number, method, target, headers, body)
        except _TryNext as last:
            return _answer_or_raise(last, len(targets))
        raise UpstreamUnavailable(len(targets), "no attempt made")

    async def _attempt(
        self,
        destination: str,
        number: int,
        method: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
    ) -> Opened:
        try:
            response = await self._client().request(
                method,
                f"http://{destination}{target}",
                headers=headers,
                data=body or None,
                allow_redirects=False,
            )
        except _BEFORE_HEADERS as exc:
            raise _TryNext(f"{destination}: {type(exc).__name__}") from exc
        opened = Opened(response, destination, number)
        if response.status in _RETRIED_STATUSES:  # as the shipped Envoy route's retriable_status_codes
            opened.head, opened.complete = await _read_capped(response)
            raise _TryNext(f"{destination}: refused with {response.status}", opened)
        return opened

    async def call(
        self,
        destination: str,
        target: str,
        headers: list[tuple[str, str]],
        body: bytes,
        limit: int,
        timeout_s: float,
    ) -> tuple[int, bytes | None]:
        """One POST to `destination` and its whole answer (None: longer than `limit` bytes), within
        `timeout_s`; never retried. Raises UpstreamUnavailable (unreachable, reset) or TimeoutError.
        A caller cancelled meanwhile closes the connection, so the engine aborts the request."""
        async with asyncio.timeout(timeout_s):
            try:
                response = await self._client().request(
                    "POST", f"http://{destination}{target}", headers=headers, data=body, allow_redirects=False
                )
            except _BEFORE_HEADERS as exc:
                if isinstance(exc, TimeoutError):
                    raise
                raise UpstreamUnavailable(1, f"{destination}: {type(exc).__name__}") from exc
            try:
                out = bytearray()
                while chunk := await response.content.readany():
                    out += chunk
                    if len(out) > limit:
                        return response.status, None
                response.release()  # read to its end: the connection goes back to the pool
                return response.status, bytes(out)
            except aiohttp.ClientError as exc:
                raise UpstreamUnavailable(1, f"{destination}: {type(exc).__name__}") from exc
            finally:
                response.close()  # a no-op once released; else the connection closes (vLLM aborts)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def _answer_or_raise(failure: _TryNext, attempts: int) -> Opened:
    """The last endpoint's refusal is the answer; no answer at all is UpstreamUnavailable."""
    if failure.opened is not None:
        return failure.opened
    raise UpstreamUnavailable(attempts, str(failure)) from None


def _discard(failure: BaseException | None) -> None:
    """A refusal the next attempt supersedes: its response is not the answer, so close it."""
    if isinstance(failure, _TryNext) and failure.opened is not None:
        failure.opened.response.close()


async def _read_capped(response: aiohttp.ClientResponse) -> tuple[bytes, bool]:
    """Up to the cap of a refusal's body, and whether that was all of it (else the caller streams
    the rest: a passed-through 5xx body is never cut)."""
    out = bytearray()
    try:
        while len(out) < _REFUSAL_READ_CAP:
            chunk = await response.content.readany()
            if not chunk:
                response.release()  # read to its end: the connection goes back to the pool
                return bytes(out), True
            out += chunk
    except UPSTREAM_READ_ERRORS:
        response.close()
        return bytes(out), True  # broken off: what came is all there will be
    return bytes(out), response.content.at_eof()
