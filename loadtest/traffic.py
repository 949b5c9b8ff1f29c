"""Closed-loop streaming traffic with per-request results: used by the demo, benchmarks and tests.

Bounded twice: by a request count and by a deadline, whichever comes first.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx

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
    """One streaming completion; never raises (transport errors land in `Result.error`).

    `first_event` is set when the first SSE event arrives: the stream is flowing to the client."""
    result = Result()
    started = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as response:
            result.status = response.status_code
            result.replica = response.headers.get(REPLICA_HEADER, "")
            result.reason_header = response.headers.get("x-picker-dropped-reason", "")
            result.retry_after = response.headers.get("retry-after", "")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                    if first_event is not None:
                        first_event.set()
                payload = line[6:]
                if payload == "[DONE]":
                    result.done = True
                    continue
                result.chunks += 1
                if '"finish_reason":null' not in payload.replace(" ", ""):
                    event = json.loads(payload)
                    if "error" in event:
                        result.error = "error event"
                    for choice in event.get("choices", ()):
                        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except httpx.HTTPError as exc:
        result.error = type(exc).__name__
    result.duration_s = time.perf_counter() - started
    return result


async def run_closed_loop(
    url: str,
    *,
    concurrency: int,
    max_requests: int,
    deadline_s: float,
    max_tokens: int = 20,
    headers: dict[str, str] | None = None,
    http2: bool = False,
) -> Report:
    """`concurrency` workers each send one request after another until either bound is reached."""
    report = Report()
    started = time.perf_counter()
    stop_at = started + deadline_s
    issued = 0
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    timeout = httpx.Timeout(30.0, connect=5.0)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, http1=not http2, http2=http2) as client:

        async def worker() -> None:
            nonlocal issued
            while issued < max_requests and time.perf_counter() < stop_at:
                issued += 1
                report.results.append(await stream_one(client, url, completion_body(max_tokens), headers))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    report.wall_s = time.perf_counter() - started
    return report
