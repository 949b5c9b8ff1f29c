"""Benchmark: what the picker costs per request and per token (issue 15), each figure beside its baseline.

Three data paths over the same simulated replicas (TTFT 5 ms), in one run:
  envoy   Envoy alone, round robin (no picker: the baseline)
  picker  the shipped config: routing filter + an observability-mode filter that sees every chunk
  floor   the shipped config in front of a server that decides nothing (loadtest/ext_proc_bare.py
          --shipped): Python gRPC's own cost in the shipped shape, under the picker's (--no-floor)
  lean    the routing filter alone: Envoy's gRPC access log ends each request (no per-chunk cost;
          loses token counts, TTFT/ITL histograms, error events and silent-abort detection), its
          entries flushed every 10 ms (--lean-flush) so that in-flight counts follow the ends closely
  traced  the shipped config with `--tracing`: every request a trace, batched over OTLP/gRPC to a
          collector on loopback (loadtest/otlp_collector.py); `picker` is the same with tracing off
  plain1 / plain2 / plain2s  one picker, two with one set of books (`--peers`), two with separate
          books, all plaintext (issue 23); the `pickers` part runs their short requests in interleaved
          rounds, since this machine drifts 10-20 % between runs of a few seconds
Cost is CPU time (per-process user + system from /proc), which a loaded machine skews far less than
latency; the client's and the simulators' own CPU are printed beside the picker's, and the machine's
load average with each part. Every part is bounded in requests and time (about 3-4 minutes in all).
Run: `python -m loadtest.bench_cost`.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loadtest.bench_picker import start_baseline_envoy, start_floor
from loadtest.otlp_collector import Collector
from loadtest.procs import Proc
from loadtest.rawclient import cpu_seconds, wakeups
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import percentile

MODEL = "tiny-llama"
CHUNK_ITL_MS = 50  # 20 tokens/s: the stream rate


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


# --- raw HTTP/1.1 clients (no HTTP library: the client's own cost stays small and is reported) ---------


def _request(body: bytes, extra: bytes = b"", close: bool = False) -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
        + extra
        + (b"connection: close\r\n" if close else b"")
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def _body(tokens: int, stream: bool, prompt: str = "hi") -> bytes:
    flag = b"true" if stream else b"false"
    return b'{"model":"%s","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":%s}' % (
        MODEL.encode(),
        prompt.encode(),
        tokens,
        flag,
    )


async def short_requests(port: int, workers: int, count: int, seconds: float) -> tuple[int, int, float]:
    """Non-streaming 1-token requests on keep-alive connections: (ok, failed, wall seconds)."""
    request = _request(_body(1, stream=False))
    ok = failed = issued = 0
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal ok, failed, issued
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while issued < count and time.monotonic() < stop_at:
                issued += 1
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                if head[9:12] == b"200":
                    ok += 1
                else:
                    failed += 1
        except (OSError, asyncio.IncompleteReadError):
            failed += 1
        finally:
            writer.close()

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return ok, failed, time.monotonic() - started


@dataclass
class Stream:
    started: float = 0.0
    first: float | None = None
    chunks: int = 0
    done: bool = False


class _StreamProtocol(asyncio.Protocol):
    def __init__(self, request: bytes, result: Stream, finished: asyncio.Future[None]) -> None:
        self._request, self._result, self._finished = request, result, finished

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._result.started = time.perf_counter()
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        count = data.count(b"data: ")
        if count and self._result.first is None:
            self._result.first = time.perf_counter()
        self._result.chunks += count
        if b"data: [DONE]" in data:
            self._result.done = True
            self._result.chunks -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._finished.done():
            self._finished.set_result(None)


async def one_stream(port: int, request: bytes, limit_s: float) -> Stream:
    result = Stream()
    finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    try:
        transport, _ = await asyncio.get_running_loop().create_connection(
            lambda: _StreamProtocol(request, result, finished), "127.0.0.1", port
        )
        try:
            await asyncio.wait_for(finished, limit_s)
        finally:
            transport.close()
    except (OSError, TimeoutError):
        pass
    return result


def stream_request(
    tokens: int, itl_ms: float | None = None, prompt: str = "hi", extra_headers: bytes = b""
) -> bytes:
    extra = b"x-sim-itl-ms: %d\r\n" % itl_ms if itl_ms is not None else b""
    return _request(_body(tokens, stream=True, prompt=prompt), extra + extra_headers, close=True)


async def closed_loop(
    port: int, request: bytes, workers: int, count: int, seconds: float
) -> tuple[list[Stream], float]:
    """`workers` clients, one stream after another, until `count` streams or `seconds`."""
    results: list[Stream] = []
    issued = 0
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal issued
        while issued < count and time.monotonic() < stop_at:
            issued += 1
            results.append(await one_stream(port, request, 30))

    started = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(workers)))
    return results, time.monotonic() - started


def ttfts(results: list[Stream]) -> list[float]:
    return sorted(r.first - r.started for r in results if r.first is not None and r.done)


# --- CPU accounting ---------------------------------------------------------------------------------


Pids = int | tuple[int, ...]  # one process, or several counted as one (two pickers)


def _each(pids: Pids) -> tuple[int, ...]:
    return pids if isinstance(pids, tuple) else (pids,)


def _cpu(pids: Pids, main_thread: bool = False) -> float:
    return sum(cpu_seconds(pid, main_thread) for pid in _each(pids))


def _wakeups(pids: Pids) -> int:
    return sum(wakeups(pid) for pid in _each(pids))


@dataclass
class Meter:
    """CPU seconds of named processes (and this client) over one measured window, less idle rates."""

    pids: dict[str, Pids]
    idle: dict[str, float] = field(default_factory=dict)  # CPU seconds per second when idle
    cpu: dict[str, float] = field(default_factory=dict)
    wakeups: dict[str, int] = field(default_factory=dict)  # voluntary context switches in the window
    main: dict[str, float] = field(default_factory=dict)  # the main threads' CPU (event loops), idle included
    wall: float = 0.0

    @contextmanager
    def window(self) -> Iterator[Meter]:
        before = {name: _cpu(pid) for name, pid in self.pids.items()}
        woken = {name: _wakeups(pid) for name, pid in self.pids.items()}
        mains = {name: _cpu(pid, main_thread=True) for name, pid in self.pids.items()}
        client_before, started = time.process_time(), time.monotonic()
        yield self
        self.wall = time.monotonic() - started
        self.wakeups = {name: _wakeups(pid) - woken[name] for name, pid in self.pids.items()}
        self.main = {name: _cpu(pid, main_thread=True) - mains[name] for name, pid in self.pids.items()}
        self.cpu = {
            name: _cpu(pid) - before[name] - self.idle.get(name, 0.0) * self.wall
            for name, pid in self.pids.items()
        }
        self.cpu["client"] = time.process_time() - client_before


async def idle_rates(pids: dict[str, Pids], seconds: float) -> dict[str, float]:
    before, started = {n: _cpu(p) for n, p in pids.items()}, time.monotonic()
    await asyncio.sleep(seconds)  # a measurement window, not a synchronisation
    wall = time.monotonic() - started
    return {n: (_cpu(p) - before[n]) / wall for n, p in pids.items()}


# --- the stacks ---------------------------------------------------------------------------------------


@dataclass
class Paths:
    ports: dict[str, int]  # envoy / picker / lean (/ plain1 / plain2 / plain2s) -> listen port
    pickers: dict[str, Pids]  # picker / lean -> picker pid(s)
    sims: int
    envoys: dict[str, int]


# --- the parts ----------------------------------------------------------------------------------------


async def part_idle(paths: Paths, seconds: float) -> dict[str, float]:
    rates = await idle_rates(paths.pickers, seconds)
    print(f"\n[idle] picker CPU with 3 endpoints scraped every 100 ms, {seconds:.0f} s ({load()})")
    for name, rate in rates.items():
        print(f"  {name:<7} {rate * 100:5.2f} % of a core   (issue baseline: 4.6 %)")
    return rates


async def part_short(paths: Paths, idle: dict[str, float], levels: list[int], seconds: float) -> None:
    print(f"\n[short requests] non-streaming, 1 token, keep-alive; picker CPU less its idle rate ({load()})")
    print(
        f"{'conc':>4} | {'path':<6} | {'ok':>5} | {'fail':>4} | {'req/s':>6} | {'picker us/req':>13} | "
        f"{'req per picker core-s':>21} | {'envoy us/req':>12} | {'sims us/req':>11} | {'client us/req':>13}"
    )
    for level in levels:
        count = 300 if level == 1 else 3000
        for name, port in paths.ports.items():
            pids = {"picker": paths.pickers.get(name, 0), "envoy": paths.envoys[name], "sims": paths.sims}
            pids = {k: v for k, v in pids.items() if v}
            meter = Meter(pids, idle={"picker": idle.get(name, 0.0)})
            with meter.window():
                ok, failed, wall = await short_requests(port, level, count, seconds)
            n = max(ok, 1)
            picker = meter.cpu.get("picker")
            us = f"{picker / n * 1e6:>13.0f}" if picker is not None else f"{'-':>13}"
            per_core = f"{n / picker:>21.0f}" if picker else f"{'-':>21}"
            print(
                f"{level:>4} | {name:<6} | {ok:>5} | {failed:>4} | {ok / wall:>6.0f} | {us} | {per_core} | "
                f"{meter.cpu['envoy'] / n * 1e6:>12.0f} | {meter.cpu['sims'] / n * 1e6:>11.0f} | "
                f"{meter.cpu['client'] / n * 1e6:>13.0f}"
            )
    print("  goal: <= 650 us per request (>= 1,500 per picker core-second); issue baseline 1.6-1.7 ms")


async def part_pickers(paths: Paths, idle: dict[str, float], level: int, rounds: int, seconds: float) -> None:
    """One picker against two (shared books, separate books): short requests, rounds interleaved, so
    that the machine's drift between runs (10-20 % here) falls on every path alike; the ratio per
    round is to that round's one picker."""
    names = [n for n in ("plain1", "plain2", "plain2s") if n in paths.ports]
    if "plain1" not in names:
        print("\n[pickers] skipped: needs the plain1 / plain2 / plain2s paths")
        return
    print(
        f"\n[pickers] short requests at {level} concurrent, {rounds} rounds interleaved; picker CPU "
        f"per request (all pickers of a path, less their idle rate) and its ratio to plain1's ({load()})"
    )
    # wakes: the pickers' wake-ups per request (voluntary context switches of all their threads);
    # main: the main threads' CPU per request, idle included (the event loop: Python, uvloop,
    # grpc.aio's glue); the rest is gRPC's threads (its C core's event engine, the CQ poller)
    print(
        f"{'round':>5} | "
        + " | ".join(f"{n + ' us/req':>14} {'ratio':>6} {'wakes':>5} {'main':>5}" for n in names)
    )
    figures: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    wakes: dict[str, list[float]] = {n: [] for n in names}
    mains: dict[str, list[float]] = {n: [] for n in names}
    for index in range(rounds):
        row: dict[str, float] = {}
        for name in names:
            meter = Meter({"picker": paths.pickers[name]}, idle={"picker": idle.get(name, 0.0)})
            with meter.window():
                ok, _, _ = await short_requests(paths.ports[name], level, 3000, seconds)
            row[name] = meter.cpu["picker"] / max(ok, 1) * 1e6
            figures[name].append(row[name])
            ratios[name].append(row[name] / row["plain1"])
            wakes[name].append(meter.wakeups["picker"] / max(ok, 1))
            mains[name].append(meter.main["picker"] / max(ok, 1) * 1e6)
        print(
            f"{index + 1:>5} | "
            + " | ".join(
                f"{row[n]:>14.0f} {ratios[n][-1]:>6.3f} {wakes[n][-1]:>5.2f} {mains[n][-1]:>5.0f}"
                for n in names
            )
        )
    print(
        f"{'med':>5} | "
        + " | ".join(
            f"{statistics.median(figures[n]):>14.0f} {statistics.median(ratios[n]):>6.3f} "
            f"{statistics.median(wakes[n]):>5.2f} {statistics.median(mains[n]):>5.0f}"
            for n in names
        )
    )
    for name in names[1:]:
        print(f"  {name}/plain1 per round: {min(ratios[name]):.3f}-{max(ratios[name]):.3f}")
    print("  goal (issue 23): two pickers with one set of books <= 1.10 x one picker")


async def streams_cpu(
    paths: Paths, name: str, streams: int, tokens: int, idle: float
) -> tuple[int, Meter, int]:
    port = paths.ports[name]
    pids: dict[str, Pids] = {"sims": paths.sims}
    if name in paths.pickers:
        pids["picker"] = paths.pickers[name]
    meter = Meter(pids, idle={"picker": idle})
    request = stream_request(tokens, CHUNK_ITL_MS)
    with meter.window():
        tasks = []
        for _ in range(streams):  # spread the streams' phases over a second
            tasks.append(asyncio.create_task(one_stream(port, request, tokens * CHUNK_ITL_MS / 1e3 + 30)))
            await asyncio.sleep(1.0 / streams)
        results = await asyncio.gather(*tasks)
    return sum(r.chunks for r in results), meter, sum(1 for r in results if not r.done)


async def part_chunks(paths: Paths, idle: dict[str, float], streams: int, tokens: int) -> None:
    print(
        f"\n[per chunk] {streams} concurrent streams at 20 tokens/s; marginal cost = (CPU of {tokens}-token "
        f"streams - CPU of 2-token streams) / extra chunks ({load()})"
    )
    print(
        f"{'path':<6} | {'chunks':>6} | {'fail':>4} | {'picker us/chunk':>15} | {'marginal':>8} | "
        f"{'streams at 20 tok/s per core':>28} | {'sims us/chunk':>13} | {'client us/chunk':>15}"
    )
    for name in paths.ports:
        chunks, meter, failed = await streams_cpu(paths, name, streams, tokens, idle.get(name, 0.0))
        short_chunks, short_meter, short_failed = await streams_cpu(
            paths, name, streams, 2, idle.get(name, 0.0)
        )
        if "picker" in meter.cpu:
            total = f"{meter.cpu['picker'] / chunks * 1e6:>15.1f}"
            extra = (meter.cpu["picker"] - short_meter.cpu["picker"]) / max(1, chunks - short_chunks)
            marginal = f"{extra * 1e6:>8.1f}"
            per_stream = meter.cpu["picker"] / streams / (tokens * CHUNK_ITL_MS / 1e3)  # core-s per stream-s
            capacity = f"{1 / per_stream:>28.0f}"
        else:
            total, marginal, capacity = f"{'-':>15}", f"{'-':>8}", f"{'-':>28}"
        print(
            f"{name:<6} | {chunks:>6} | {failed + short_failed:>4} | {total} | {marginal} | {capacity} | "
            f"{meter.cpu['sims'] / chunks * 1e6:>13.1f} | {meter.cpu['client'] / chunks * 1e6:>15.1f}"
        )
    print(
        "  goal: <= 25 us per chunk (>= 2,000 streams at 20 tokens/s per core), or zero in a mode that "
        "knows each stream's end; issue baseline 92 us"
    )


async def part_streams(paths: Paths, idle: dict[str, float], levels: list[int], seconds: float) -> None:
    """Issue 56's side-by-side run: 8-token streams in a closed loop at each level, every path in
    turn: requests/s against Envoy alone's, TTFT p50 and what the path adds to it, and the picker's CPU
    per request (less its idle rate)."""
    print(f"\n[8-token streams] closed loop, {seconds:.0f} s per path and level ({load()})")
    print(
        f"{'conc':>4} | {'path':<6} | {'req/s':>6} | {'of Envoy':>8} | {'TTFT p50 ms':>11} | "
        f"{'added ms':>8} | {'picker us/req':>13} | {'failed':>6}"
    )
    request = stream_request(8)
    spent: dict[tuple[int, str], float] = {}  # (level, path) -> server CPU per request, us
    for level in levels:
        rate0 = ttft0 = 0.0
        for name, port in paths.ports.items():
            pids = {"picker": paths.pickers.get(name, 0)}
            meter = Meter({k: v for k, v in pids.items() if v}, idle={"picker": idle.get(name, 0.0)})
            with meter.window():
                results, wall = await closed_loop(port, request, level, 100_000, seconds)
            good = [r for r in results if r.done]
            rate, p50 = len(good) / wall, percentile(ttfts(results), 50) * 1e3
            if name == "envoy":
                rate0, ttft0 = rate, p50
            picker = meter.cpu.get("picker")
            if picker is not None:
                spent[level, name] = picker / max(len(good), 1) * 1e6
            us = f"{spent[level, name]:>13.0f}" if picker is not None else f"{'-':>13}"
            share = f"{rate / rate0 * 100:>7.0f}%" if rate0 else f"{'-':>8}"
            added = f"{p50 - ttft0:>+8.2f}" if name != "envoy" else f"{'-':>8}"
            print(
                f"{level:>4} | {name:<6} | {rate:>6.0f} | {share} | {p50:>11.2f} | {added} | {us} | "
                f"{len(results) - len(good):>6}"
            )
    for level in levels:
        if (level, "floor") in spent and (level, "picker") in spent:
            floor, picker = spent[level, "floor"], spent[level, "picker"]
            print(
                f"  at {level}: gRPC's floor in the shipped shape {floor:.0f} us a request, the picker's "
                f"own {picker - floor:.0f} us ({(picker - floor) / picker * 100:.0f} % of its {picker:.0f})"
            )
    print(
        "  goals (issue 56): >= 90 % of Envoy alone's requests/s at 20, >= 70 % at 60; picker CPU per "
        "8-token stream <= 900 us at 60; added TTFT p50 <= 3 ms at 20"
    )


async def part_ttft(paths: Paths, levels: list[int]) -> None:
    print(f"\n[added TTFT] 4-token streams, closed loop, paths interleaved per level ({load()})")
    print(
        f"{'conc':>4} | {'path':<6} | {'streams':>7} | {'p50 ms':>7} | {'p99 ms':>7} | "
        f"{'added p50/p99 ms':>16}"
    )
    request = stream_request(4)
    for level in levels:
        count = max(150, level * 6)
        base: list[float] = []
        for name, port in paths.ports.items():
            results, _ = await closed_loop(port, request, level, count, 30)
            got = ttfts(results)
            p50, p99 = percentile(got, 50) * 1e3, percentile(got, 99) * 1e3
            if name == "envoy":
                base, added = [p50, p99], ""
            else:
                added = f"{p50 - base[0]:+7.2f} /{p99 - base[1]:+7.2f}"
            print(f"{level:>4} | {name:<6} | {len(got):>7} | {p50:>7.2f} | {p99:>7.2f} | {added:>16}")
    print("  goal: added <= 1 ms p50 / <= 3 ms p99 at 1 and 16 streams; within 20 % of Envoy alone at 64")


async def part_long_prompts(paths: Paths, idle: dict[str, float], levels: list[int], count: int) -> None:
    prompt = "lorem ipsum " * (220_000 // 12)
    request = stream_request(8, prompt=prompt)
    print(
        f"\n[220 KB prompts] 8-token streams, {len(request) // 1000} KB requests, {count} per path ({load()})"
    )
    print(
        f"{'conc':>4} | {'path':<6} | {'ok':>5} | {'fail':>4} | {'req/s':>6} | {'TTFT p50':>8} | "
        f"{'vs Envoy':>8} | {'picker us/req':>13}"
    )
    for level in levels:
        base = 0.0
        for name, port in paths.ports.items():
            pids = {"picker": paths.pickers[name]} if name in paths.pickers else {}
            meter = Meter(pids, idle={"picker": idle.get(name, 0.0)})
            with meter.window():
                results, wall = await closed_loop(port, request, level, count, 60)
            good = [r for r in results if r.done]
            p50 = percentile(ttfts(results), 50) * 1e3
            if name == "envoy":
                base, versus = p50, ""
            else:
                versus = f"{p50 - base:+8.1f}"
            us = (
                f"{meter.cpu['picker'] / max(1, len(good)) * 1e6:>13.0f}"
                if "picker" in meter.cpu
                else f"{'-':>13}"
            )
            print(
                f"{level:>4} | {name:<6} | {len(good):>5} | {len(results) - len(good):>4} | "
                f"{len(good) / wall:>6.0f} | "
                f"{p50:>8.1f} | {versus:>8} | {us}"
            )
    print("  goal: TTFT within 5 ms p50 of Envoy alone; no request fails")


_RSS_PROBE = """
import gc, sys
from picker.request.pipeline import RequestPath
from picker.pool import Pool
from picker.request.inference import InferenceRequest
from picker.observability.metrics import Metrics

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

n = int(sys.argv[1])
pool = Pool()
pool.apply(ready=[f"127.0.0.1:{8000 + i}" for i in range(3)])
path = RequestPath(pool, Metrics(pool="default"), fallback_count=2, schedule=lambda d, f: (lambda: None))
chunk = (b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m",'
         b'"choices":[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\\n\\n')
gc.collect()
before = rss()
records = []
for i in range(n):
    ticket = path.admit(InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True))
    record = ticket.payload
    path.response_started(record, 200, None, True)
    for _ in range(3):
        path.body_chunk(record, chunk)
    records.append(record)
gc.collect()
after = rss()
print(path.live, before, after)
"""


def part_rss(streams: int, picker_pid: int) -> None:
    print(f"\n[memory] {streams:,} tracked streams ({load()})")
    run = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(streams)], capture_output=True, text=True, timeout=120
    )
    if run.returncode != 0:
        print(f"  unit-level probe failed: {run.stderr.strip().splitlines()[-1:]}")
    else:
        live, before, after = (int(v) for v in run.stdout.split())
        print(
            f"  unit level (RequestPath + records + trackers, no gRPC): {live:,} live streams add "
            f"{(after - before) / 1e6:.1f} MB ({(after - before) / max(1, live):,.0f} bytes each); "
            f"process RSS {after / 1e6:.0f} MB"
        )
    rss = 0
    for line in Path(f"/proc/{picker_pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    print(f"  the running picker after this benchmark: RSS {rss / 1e6:.0f} MB")
    print("  goal: <= 300 MB with 10,000 tracked streams")


# --- main -------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> None:
    print(f"bench_cost on {os.cpu_count()} cores, {load()} at start")
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp:
        workdir = Path(tmp)
        stack = Stack(
            workdir / "picker",
            StackOptions(
                replicas=3, sim_args=("--ttft-ms", "5", "--itl-ms", "10", "--max-model-len", "1000000")
            ),
        )
        (workdir / "picker").mkdir()
        (workdir / "lean").mkdir()
        lean: Stack | None = None
        traced: Stack | None = None
        others: list[Stack] = []
        floors: list[Proc] = []
        collector = Collector().start() if args.traced else None
        baseline: Proc | None = None
        await asyncio.to_thread(stack.start)
        try:
            baseline, baseline_port = await asyncio.to_thread(start_baseline_envoy, stack, workdir)
            lean_options = StackOptions(
                replicas=0,
                picker_endpoints=stack.replicas,
                extra_envoy_endpoints=stack.replicas,
                observer=False,
                access_log_flush_interval=args.lean_flush,
            )
            lean = await asyncio.to_thread(Stack(workdir / "lean", lean_options).start)
            assert stack.picker and stack.sims and stack.envoy and lean.picker and lean.envoy
            paths = Paths(
                ports={"envoy": baseline_port, "picker": stack.listen_port, "lean": lean.listen_port},
                pickers={"picker": stack.picker.pid, "lean": lean.picker.pid},
                sims=stack.sims.pid,
                envoys={"envoy": baseline.pid, "picker": stack.envoy.pid, "lean": lean.envoy.pid},
            )
            if args.floor:
                server, envoy, listen = await asyncio.to_thread(start_floor, stack, workdir)
                floors.extend((server, envoy))
                paths.ports["floor"], paths.pickers["floor"], paths.envoys["floor"] = (
                    listen,
                    server.pid,
                    envoy.pid,
                )
            if args.two_pickers:  # issue 23: one picker against two with one set of books, both plaintext
                # plain2s: two pickers with separate books, what the process split alone costs
                for name, count, peers in (("plain1", 1, False), ("plain2", 2, True), ("plain2s", 2, False)):
                    (workdir / name).mkdir()
                    options = StackOptions(
                        replicas=0,
                        picker_endpoints=stack.replicas,
                        pickers=count,
                        peers=peers,
                        envoy_picker_tls=False,
                    )
                    extra = await asyncio.to_thread(Stack(workdir / name, options).start)
                    others.append(extra)
                    assert extra.envoy is not None
                    paths.ports[name] = extra.listen_port
                    paths.pickers[name] = tuple(p.pid for p in extra.pickers if p is not None)
                    paths.envoys[name] = extra.envoy.pid
            if collector is not None:
                (workdir / "traced").mkdir()
                traced_options = StackOptions(
                    replicas=0,
                    picker_endpoints=stack.replicas,
                    picker_args=("--tracing",),
                    picker_env={
                        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
                        "OTEL_EXPORTER_OTLP_INSECURE": "true",
                    },
                )
                traced = await asyncio.to_thread(Stack(workdir / "traced", traced_options).start)
                assert traced.picker and traced.envoy
                paths.ports["traced"] = traced.listen_port
                paths.pickers["traced"] = traced.picker.pid
                paths.envoys["traced"] = traced.envoy.pid
            parts: dict[str, Callable[[], Awaitable[None]]] = {}
            idle = await part_idle(paths, args.idle_seconds)
            levels = [int(v) for v in args.short_levels.split(",")]
            parts["short"] = lambda: part_short(paths, idle, levels, args.seconds)
            parts["pickers"] = lambda: part_pickers(
                paths, idle, args.pickers_level, args.rounds, args.seconds
            )
            parts["chunks"] = lambda: part_chunks(paths, idle, args.streams, args.tokens)
            stream_levels = [int(v) for v in args.stream_levels.split(",")]
            parts["streams"] = lambda: part_streams(paths, idle, stream_levels, args.seconds)
            parts["ttft"] = lambda: part_ttft(paths, [int(v) for v in args.ttft_levels.split(",")])
            parts["prompts"] = lambda: part_long_prompts(
                paths, idle, [int(v) for v in args.prompt_levels.split(",")], args.prompt_count
            )
            for name in args.parts.split(","):
                if name in parts:
                    await parts[name]()
            if "rss" in args.parts.split(","):
                part_rss(args.rss_streams, stack.picker.pid)
            client_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3
            print(f"\nclient process max RSS {client_rss:.0f} MB; {load()} at end")
        finally:
            gc.collect()
            if lean is not None:
                lean.stop()
            if traced is not None:
                traced.stop()
            for other in others:
                other.stop()
            for proc in floors:
                proc.stop()
            if collector is not None:
                print(f"collector received {len(collector.spans)} spans from the traced path")
                collector.stop()
            if baseline is not None:
                baseline.stop()
            stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parts", default="short,pickers,chunks,streams,ttft,prompts,rss")
    parser.add_argument("--idle-seconds", type=float, default=3.0)
    parser.add_argument(
        "--no-two-pickers",
        dest="two_pickers",
        action="store_false",
        help="skip the plain1 / plain2 / plain2s paths (one picker, two with shared books, two with "
        "separate books; plaintext to the picker)",
    )
    parser.add_argument(
        "--no-floor", dest="floor", action="store_false", help="leave out the floor path (gRPC alone)"
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="bound of each throughput phase")
    parser.add_argument("--short-levels", default="1,20,60")
    parser.add_argument("--stream-levels", default="20,60", help="concurrency of the 8-token streams part")
    parser.add_argument("--pickers-level", type=int, default=20, help="concurrency of the pickers part")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the pickers part")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams of the per-chunk part")
    parser.add_argument("--tokens", type=int, default=60)
    parser.add_argument("--ttft-levels", default="1,16,64")
    parser.add_argument("--prompt-levels", default="20,60")
    parser.add_argument("--prompt-count", type=int, default=120)
    parser.add_argument("--rss-streams", type=int, default=10_000)
    parser.add_argument("--lean-flush", default="0.01s", help="the lean path's access-log flush interval")
    parser.add_argument(
        "--no-traced", dest="traced", action="store_false", help="leave out the path with tracing on"
    )
    args = parser.parse_args()
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
