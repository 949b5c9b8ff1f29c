"""Closed-loop streaming traffic with per-request results: used by the demo, benchmarks and tests.

Bounded twice: by a request count and by a deadline, whichever comes first.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

from loadtest import http_client
from loadtest.sse_client import stream_request

REPLICA_HEADER = "x-sim-replica"


@dataclass
class Result:
    status: int = 0
    replica: str = ""
    ttft_s: float | None = None
    duration_s: float = 0.0
    chunks: int = 0
    done: bool = False  # saw data: [DONE]
    finish_reason: str | None = None
    reason_header: str = ""
    retry_after: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return (
            self.status == 200 and self.done and not self.error and self.finish_reason in ("length", "stop")
        )


@dataclass
class Report:
    results: list[Result] = field(default_factory=list)
    wall_s: float = 0.0

    def by_replica(self) -> Counter[str]:
        return Counter(r.replica or "(none)" for r in self.results)

    def statuses(self) -> Counter[int]:
        return Counter(r.status for r in self.results)

    def ttfts(self) -> list[float]:
        return sorted(r.ttft_s for r in self.results if r.ttft_s is not None)

    def failures(self) -> list[Result]:
        return [r for r in self.results if not r.ok]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))]


def completion_body(max_tokens: int, model: str = "tiny-llama", stream: bool = True) -> dict[str, object]:
    return {
        "model": model,
        "prompt": "Say something long.",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def stream_one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, object],
    headers: dict[str, str] | None = None,
    first_event: asyncio.Event | None = None,
) -> Result:
    """One streaming completion, summed up; never raises (transport errors land in `Result.error`).

    `first_event` is set when the first SSE event arrives: the stream is flowing to the client."""
    streamed = await stream_request(
        client, url + "/v1/completions", body, headers=headers, first_event=first_event
    )
    data = [event for event in streamed.events if event.data != "[DONE]"]
    response_headers = streamed.headers
    return Result(
        status=streamed.status or 0,
        replica=response_headers.get(REPLICA_HEADER, ""),
        ttft_s=streamed.events[0].at if streamed.events else None,
        duration_s=streamed.t_end,
        chunks=len(data),
        done=streamed.done,
        finish_reason=streamed.finish_reason,
        reason_header=response_headers.get("x-picker-dropped-reason", ""),
        retry_after=response_headers.get("retry-after", ""),
        error="error event" if streamed.error_event else (streamed.error or ""),
    )


async def run_closed_loop(
    url: str,
    *,
    concurrency: int,
    max_requests: int,
    deadline_s: float,
    max_tokens: int = 20,
    headers: dict[str, str] | None = None,
    http2: bool = False,
    tokens_spread: int = 0,
) -> Report:
    """`concurrency` workers each send one request after another until either bound is reached.

    Each asks for `max_tokens`, or with `tokens_spread` a length drawn uniformly within that many
    tokens of it (seeded: the same lengths every run), so that the streams' ends do not come in waves.
    """
    report = Report()
    lengths = random.Random(23)
    low, high = max(1, max_tokens - tokens_spread), max_tokens + tokens_spread
    started = time.perf_counter()
    stop_at = started + deadline_s
    issued = 0
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    timeout = httpx.Timeout(30.0, connect=5.0)

    async with http_client.AsyncClient(
        limits=limits, timeout=timeout, http1=not http2, http2=http2
    ) as client:

        async def worker() -> None:
            nonlocal issued
            while issued < max_requests and time.perf_counter() < stop_at:
                issued += 1
                body = completion_body(lengths.randint(low, high) if tokens_spread else max_tokens)
                report.results.append(await stream_one(client, url, body, headers))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.wall_s = time.perf_counter() - started
    return report
