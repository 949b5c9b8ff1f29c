"""How many concurrent streams one simulator process sustains with accurate token timing.

Starts `python -m vllm_sim` (one process = one core: it is single-threaded). For each concurrency
level it opens that many streaming completions (spread over a ramp so token phases interleave), measures
during a window the chunks/s received, the simulator's CPU use and the ITL error (actual gap between the
chunks of a stream minus the configured ITL, as the client sees it), then disconnects them all. The
client is a raw asyncio protocol on uvloop so that it costs far less than the server it measures. The
simulator's CPU share is read from /proc: on a shared box a level can fail for lack of CPU time while
the CPU column stays low.

    python -m loadtest.bench_sim [--levels 100,250,500,750,1000] [--itl-ms 50] [--window-s 5] [--pin]

Bounded: at most ~60 s (levels stop early once the simulator saturates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from loadtest import http_client

SATURATED_CPU = 0.95  # a level using more than this share of the simulator's core is not sustained
SATURATED_P99_MS = 5.0  # nor one whose p99 ITL error exceeds this
TIME_BUDGET_S = 55.0


@dataclass
class Window:
    start: float = float("inf")  # set when measuring begins
    end: float = float("inf")
    gaps: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    frames: int = 0
    errors: int = 0


class StreamProtocol(asyncio.Protocol):
    """One streaming request on a raw connection; counts `\\n\\n`-terminated SSE frames as they arrive."""

    def __init__(self, request: bytes, window: Window) -> None:
        self._request = request
        self._window = window
        self._last: float | None = None
        self._started = 0.0
        self._tail_lf = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses
        self._started = time.perf_counter()
        self.transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        frames = data.count(b"\n\n") + (1 if self._tail_lf and data[:1] == b"\n" else 0)
        self._tail_lf = data[-1:] == b"\n"
        if not frames:
            if data.startswith(b"HTTP/1.1 ") and not data.startswith(b"HTTP/1.1 200"):
                self._window.errors += 1
            return
        window = self._window
        in_window = window.start <= now <= window.end
        if self._last is None:
            window.ttfts.append(now - self._started)
            frames -= 1
            self._last = now
        if in_window:
            window.frames += frames
            if frames:
                window.gaps.append(now - self._last)
                window.gaps.extend([0.0] * (frames - 1))
        self._last = now

    def connection_lost(self, exc: Exception | None) -> None:
        if self._window.start <= time.perf_counter() <= self._window.end:
            self._window.errors += 1


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def lateness_buckets(http: httpx.AsyncClient) -> list[tuple[float, float]]:
    """The simulator's own `sim_token_lateness_seconds` buckets: (upper bound, cumulative count)."""
    text = (await http.get("/metrics")).text
    return [
        (float(sample.labels["le"]), sample.value)
        for family in text_string_to_metric_families(text)
        if family.name == "sim_token_lateness_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket")
    ]


def bucket_percentile(
    before: list[tuple[float, float]], after: list[tuple[float, float]], share: float
) -> float:
    """Upper bound (ms) of the bucket holding the share-quantile of the observations between two scrapes."""
    counts = [(bound, a - b) for (bound, a), (_, b) in zip(after, before, strict=True)]
    total = counts[-1][1] if counts else 0
    for bound, cumulative in counts:
        if total and cumulative >= share * total:
            return bound * 1000
    return float("nan")


def percentile(values: list[float], share: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def start_sim(itl_ms: float, pin: bool) -> tuple[subprocess.Popen[bytes], str, int]:
    args = [sys.executable, "-m", "vllm_sim", "--port", "0", "--itl-ms", str(itl_ms), "--ttft-ms", "20"]
    args += ["--max-num-seqs", "100000", "--log-level", "WARNING", "--request-log-size", "1000"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE)
    if pin and len(os.sched_getaffinity(0)) > 1:
        os.sched_setaffinity(proc.pid, {0})
        os.sched_setaffinity(0, {1})
    assert proc.stdout is not None
    deadline = time.monotonic() + 20
    line = b""
    while not line.startswith(b"sim listening") and time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
    if not line.startswith(b"sim listening"):
        proc.kill()
        raise SystemExit("simulator did not start")
    host, port = line.split()[-1].decode().rsplit(":", 1)
    return proc, host, int(port)


async def run_level(
    host: str, port: int, pid: int, streams: int, itl_s: float, ramp_s: float, window_s: float
) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    tokens = int((ramp_s + window_s + 3) / itl_s)
    body = json.dumps({"prompt": "bench", "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    window = Window()
    protocols: list[StreamProtocol] = []
    ramp_start = loop.time()
    for index in range(streams):
        await asyncio.sleep(max(0.0, ramp_start + ramp_s * index / streams - loop.time()))
        _, protocol = await loop.create_connection(lambda: StreamProtocol(request, window), host, port)
        protocols.append(protocol)
    await asyncio.sleep(0.5)  # let the last streams pass their first token before measuring
    async with http_client.AsyncClient(base_url=f"http://{host}:{port}", timeout=10) as http:
        late_before = await lateness_buckets(http)
        cpu_before, client_before = cpu_seconds(pid), resource.getrusage(resource.RUSAGE_SELF)
        window.start = time.perf_counter()
        await asyncio.sleep(window_s)
        window.end = time.perf_counter()
        cpu = (cpu_seconds(pid) - cpu_before) / (window.end - window.start)
        client_usage = resource.getrusage(resource.RUSAGE_SELF)
        late_after = await lateness_buckets(http)
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.close()
        for _ in range(200):
            if (await http.get("/sim/state")).json()["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
    client_seconds = (
        client_usage.ru_utime + client_usage.ru_stime - client_before.ru_utime - client_before.ru_stime
    )
    errors_ms = [(gap - itl_s) * 1000 for gap in window.gaps]
    return {
        "streams": streams,
        "chunks_per_s": window.frames / (window.end - window.start),
        "sim_cpu": cpu,
        "client_cpu": client_seconds / (window.end - window.start),
        "p50": percentile(errors_ms, 0.50),
        "p99": percentile(errors_ms, 0.99),
        "max": max(errors_ms, default=float("nan")),
        "mean_abs": statistics.fmean(abs(e) for e in errors_ms) if errors_ms else float("nan"),
        "ttft_p50": percentile(window.ttfts, 0.5) * 1000,
        "late_p50": bucket_percentile(late_before, late_after, 0.50),
        "late_p99": bucket_percentile(late_before, late_after, 0.99),
        "errors": window.errors,
    }


def format_row(row: dict[str, float]) -> str:
    return (
        f" {row['streams']:>7.0f} | {row['chunks_per_s']:>8.0f} | {row['sim_cpu']:>6.0%} | "
        f"{row['client_cpu']:>10.0%} | {row['p50']:>+7.2f} / {row['p99']:>+6.2f} / {row['max']:>+7.1f}   | "
        f"{row['ttft_p50']:>6.1f} ms | {row['errors']:>6.0f} | {row['late_p50']:>4g} / {row['late_p99']:g}"
    )


async def bench(args: argparse.Namespace) -> None:
    levels = [int(level) for level in args.levels.split(",")]
    itl_s = args.itl_ms / 1000
    proc, host, port = start_sim(args.itl_ms, args.pin)
    started = time.monotonic()
    rows: list[dict[str, float]] = []
    try:
        rate = 1000 / args.itl_ms
        print(
            f"simulator pid {proc.pid} on {host}:{port}; ITL {args.itl_ms:g} ms ({rate:g} tokens/s a stream)"
        )
        print(
            " streams | chunks/s | sim CPU | client CPU | ITL err p50 / p99 / max (ms) | TTFT p50 | errors"
            " | sim lateness p50 / p99 (ms, bucket bound)"
        )
        for level in levels:
            if time.monotonic() - started + args.ramp_s + args.window_s + 2 > TIME_BUDGET_S:
                print(f"(stopping: time budget of {TIME_BUDGET_S:.0f} s)")
                break
            row = await run_level(host, port, proc.pid, level, itl_s, args.ramp_s, args.window_s)
            rows.append(row)
            print(format_row(row))
            if row["sim_cpu"] > SATURATED_CPU or row["p99"] > SATURATED_P99_MS * 4:
                break
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    sustained = [
        r for r in rows if r["sim_cpu"] <= SATURATED_CPU and r["p99"] <= SATURATED_P99_MS and not r["errors"]
    ]
    if sustained:
        best = max(sustained, key=lambda r: r["streams"])
        print(
            f"sustained: {best['streams']:.0f} concurrent streams at {1000 / args.itl_ms:g} tokens/s = "
            f"{best['chunks_per_s']:.0f} chunks/s on one core ({best['sim_cpu']:.0%} CPU), ITL error p50 "
            f"{best['p50']:+.2f} ms, p99 {best['p99']:+.2f} ms (criteria: CPU <= {SATURATED_CPU:.0%}, "
            f"p99 <= {SATURATED_P99_MS:g} ms, no errors)"
        )
    else:
        print("no level met the criteria")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--levels", default="100,250,500,750,1000", help="concurrent streams per step")
    parser.add_argument("--itl-ms", type=float, default=50.0, help="configured inter-token latency")
    parser.add_argument("--ramp-s", type=float, default=1.0, help="time over which a level's streams open")
    parser.add_argument("--window-s", type=float, default=5.0, help="measurement window per level")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="pin simulator and client to cores 0 / 1 (only on an otherwise idle box)",
    )
    args = parser.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(bench(args))


if __name__ == "__main__":
    main()
