"""Open-loop Poisson streaming load: the same seeded arrivals replayed against each setup.

Open loop: each request is sent at its arrival time whether or not earlier ones have finished, as
independent users do; a slow or failing setup cannot slow the load down and hide its own failures.
Bounded in count (the arrival list) and time (every stream has a read timeout; `hung` past it).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from loadtest import http_client
from loadtest.rollout.attribution import request_id
from loadtest.rollout.timeline import TimelineEvent, error_event, stream_event
from loadtest.sse_client import StreamResult, stream_request
from loadtest.traffic import REPLICA_HEADER, completion_body, percentile
from picker.contract.headers import REQUEST_ID

DROPPED_REASON_HEADER = "x-picker-dropped-reason"


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the load starts
    max_tokens: int


def poisson_arrivals(rate: float, duration_s: float, tokens: tuple[int, int], seed: int) -> list[Arrival]:
    """Exponential gaps at `rate` per second for `duration_s`; max_tokens uniform in `tokens`."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be > 0")
    rng = random.Random(seed)
    arrivals, at = [], rng.expovariate(rate)
    while at < duration_s:
        arrivals.append(Arrival(at, rng.randint(*tokens)))
        at += rng.expovariate(rate)
    return arrivals


@dataclass
class Outcome:
    """What one client saw, classified once so the table and the picture agree."""

    sent_s: float
    result: StreamResult
    request_id: str = ""  # the x-request-id it was sent with ("" when the run sent none)
    upstream: str = ""  # the replica a router's access log says answered (attribution.py)

    @property
    def replica(self) -> str:
        """The replica that answered: its own header (the simulator's), else the router's word."""
        return self.result.headers.get(REPLICA_HEADER, "") or self.upstream

    @property
    def kind(self) -> str:
        """completed | http-<code> | contract-<code> | truncated | abort | hung | conn-error"""
        r = self.result
        if r.end == "timeout":
            return "hung"
        if r.status is None:
            return "conn-error"
        if r.status != 200:
            reason = r.headers.get(DROPPED_REASON_HEADER)
            return f"contract-{r.status}" if reason else f"http-{r.status}"
        if r.finish_reason == "abort":
            return "abort"
        if r.done and r.finish_reason in ("length", "stop") and r.error_event is None:
            return "completed"
        return "truncated"

    @property
    def error_label(self) -> str:
        """The picture's marker label for a failed request; "" when it completed."""
        kind = self.kind
        if kind == "completed":
            return ""
        if kind.startswith("http-"):
            code = kind.removeprefix("http-")
            return (
                f"HTTP {code}" if code in ("500", "502", "503") else ("429" if code == "429" else "HTTP 5xx")
            )
        if kind == "contract-429":
            return "429"
        if kind.startswith("contract-"):
            return "contract 503"
        return {"conn-error": "conn error"}.get(kind, kind)


@dataclass
class LoadReport:
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0

    def kinds(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    def contract_reasons(self) -> Counter[str]:
        return Counter(
            f"{o.result.status} {o.result.headers.get(DROPPED_REASON_HEADER)}"
            for o in self.outcomes
            if o.kind.startswith("contract-")
        )

    def ttfts(self) -> list[float]:
        return sorted(o.result.ttft for o in self.outcomes if o.kind == "completed" and o.result.ttft)

    def ttft_ms(self, q: float) -> float:
        return percentile(self.ttfts(), q) * 1000

    def attribute(self, upstreams: dict[str, str]) -> int:
        """Set `upstream` from a request id -> replica map; returns how many outcomes got one."""
        found = 0
        for outcome in self.outcomes:
            if outcome.request_id in upstreams:
                outcome.upstream = upstreams[outcome.request_id]
                found += 1
        return found

    def timeline_events(self) -> list[TimelineEvent]:
        """Each stream answered with 200 (while it was open; on its replica's lane when known, and in
        the TTFT bars either way), each failure a marker."""
        events = []
        for outcome in self.outcomes:
            r = outcome.result
            if r.status == 200:
                start = outcome.sent_s + (r.t_headers or 0.0)
                events.append(stream_event(start, outcome.sent_s + r.t_end, outcome.replica, r.ttft))
            if outcome.error_label:
                events.append(error_event(outcome.sent_s + r.t_end, outcome.error_label, outcome.replica))
        return events


async def replay(
    url: str,
    arrivals: list[Arrival],
    *,
    origin: float | None = None,
    read_timeout_s: float = 10.0,
    model: str = "tiny-llama",
    tag: str = "",
) -> LoadReport:
    """Send every arrival at its time through `url`; returns once each has an outcome.

    `origin` (a time.monotonic() value) is time zero of the arrivals, shared with the caller's events.
    `tag`: send each request with `x-request-id: TAG-INDEX`, for a router's access log to name it."""
    report = LoadReport()
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    started = time.monotonic() if origin is None else origin

    async def one(client: httpx.AsyncClient, index: int, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - started)))
        sent = time.monotonic() - started
        body = completion_body(arrival.max_tokens, model=model)
        rid = request_id(tag, index) if tag else ""
        headers = {REQUEST_ID: rid} if rid else None
        result = await stream_request(
            client, url + "/v1/completions", body, headers=headers, read_timeout=read_timeout_s
        )
        report.outcomes.append(Outcome(sent, result, rid))

    async with http_client.AsyncClient(limits=limits) as client, asyncio.TaskGroup() as group:
        for index, arrival in enumerate(arrivals):
            group.create_task(one(client, index, arrival))
    report.outcomes.sort(key=lambda o: o.sent_s)
    report.wall_s = time.monotonic() - started
    return report
