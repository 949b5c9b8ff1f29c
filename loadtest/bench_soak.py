"""Benchmark: the picker's memory with many live streams, and over a long soak (issue 15), through the
real Envoy + picker (shipped config) + simulated replicas, each figure beside its baseline in one run.

  streams  N concurrent streaming requests held open (a token every --hold-itl-ms): the picker's RSS
           idle vs with N tracked streams (per-stream bytes, goal <= 300 MB at 10,000), Envoy's, the
           simulators' and this client's RSS beside it; then every stream is closed by the client and
           the picker's in-flight gauge must come back to 0.
  soak     --soak-requests short 8-token streams at a paced rate (at most --soak-seconds) on a fresh
           stack: the picker's and Envoy's RSS every --sample-seconds, and the growth from the end of
           the warm-up (the first 10 % of requests) to the end (goal: no growth), with the picker's CPU.
Each part starts its own stack (memory freed by one part would hide a leak in the next). The client
raises its open-file limit (the hard one too, given CAP_SYS_RESOURCE); the stack's processes inherit it:
Envoy holds two sockets per live stream. Run: `python -m loadtest.bench_soak` (full scale: ~11 min).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtest import http_client
from loadtest.bench_cost import load, one_stream, stream_request
from loadtest.rawclient import cpu_seconds
from loadtest.stack import Stack, StackOptions

GOAL_MB = 300
HOLD_TOKENS = 100_000  # a held stream never finishes by itself: the client closes it
WARMUP_SHARE = 0.10
FD_MARGIN = 128  # listeners, admin, picker connections, log files (about 50 measured)


# --- pure helpers (unit-tested) ------------------------------------------------------------------------


def parse_vmrss(status_text: str) -> int:
    """Resident set size in bytes from a /proc/PID/status text (0 when the line is missing)."""
    for line in status_text.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", unit
            return int(value) * 1024
    return 0


def parse_max_open_files(limits_text: str) -> int:
    """The soft open-file limit from a /proc/PID/limits text (-1: unlimited or not found)."""
    for line in limits_text.splitlines():
        if line.startswith("Max open files"):
            soft = line[len("Max open files") :].split()[0]
            return -1 if soft == "unlimited" else int(soft)
    return -1


def fds_needed(streams: int) -> int:
    """Open files one process of the stack may need with `streams` live streams: Envoy holds a
    downstream and an upstream socket per stream, plus listeners, picker streams and log files."""
    return 2 * streams + FD_MARGIN


def failed_ends(access_log_lines: Iterable[str]) -> Counter[str]:
    """Envoy's access log (JSON lines): the requests that did not end in a 200, by code, flags and
    details (who refused or cut them), e.g. `503 UO upstream_rq_active_overflow`."""
    ends: Counter[str] = Counter()
    for line in access_log_lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if str(entry.get("code")) != "200":
            ends[f"{entry.get('code')} {entry.get('flags')} {entry.get('details')}"] += 1
    return ends


@dataclass(frozen=True)
class Sample:
    elapsed: float
    done: int
    picker_rss: int
    envoy_rss: int
    in_flight: float


def growth(warm: Sample, end: Sample) -> tuple[float, float]:
    """RSS growth from the warm-up sample to the end, in MB, and in MB per 10k requests."""
    mb = (end.picker_rss - warm.picker_rss) / 1e6
    requests = end.done - warm.done
    return mb, (mb / requests * 10_000 if requests > 0 else float("nan"))


def slope_mb_per_10k(samples: Sequence[Sample]) -> float:
    """Least-squares slope of the picker's RSS against requests done, in MB per 10k requests: a leak
    shows as a steady slope even when the end points happen to sit on allocator noise."""
    points = [(s.done, s.picker_rss / 1e6) for s in samples]
    if len(points) < 2:
        return float("nan")
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return float("nan")
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / var * 10_000


# --- process figures -----------------------------------------------------------------------------------


def rss(pid: int) -> int:
    try:
        return parse_vmrss(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return 0


def max_open_files(pid: int) -> int:
    try:
        return parse_max_open_files(Path(f"/proc/{pid}/limits").read_text())
    except OSError:
        return -1


def raise_open_files(wanted: int) -> str:
    """Raise this process's open-file limit to `wanted` (children inherit it); says what it did."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= wanted:
        return f"open-file limit {soft} (enough)"
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, max(hard, wanted)))
    except (ValueError, OSError) as exc:
        return (
            f"open-file limit {soft}, hard {hard}: could not raise it to {wanted} ({exc}; raising the hard "
            "limit needs CAP_SYS_RESOURCE, e.g. `docker run --ulimit nofile=65536`): past about "
            f"{(hard - FD_MARGIN) // 2:,} live streams Envoy runs out of sockets (503s, connect failures)"
        )
    return f"open-file limit raised {soft} -> {wanted} (hard {max(hard, wanted)}), inherited by the stack"


def mb(value: int) -> str:
    return f"{value / 1e6:7.1f} MB"


async def in_flight(stack: Stack) -> float:
    return await asyncio.to_thread(stack.picker_value, "picker_in_flight")


async def wait_in_flight(stack: Stack, ok: Callable[[float], bool], limit_s: float, what: str) -> float:
    """Poll the picker's in-flight gauge until `ok` holds or `limit_s` passed; returns the last value."""
    deadline = time.monotonic() + limit_s
    while True:
        value = await in_flight(stack)
        if ok(value) or time.monotonic() >= deadline:
            if not ok(value):
                print(f"  ! timed out after {limit_s:.0f} s waiting for {what} (in-flight {value:.0f})")
            return value
        await asyncio.sleep(0.2)  # a poll interval under a deadline


def envoy_overflows(stack: Stack) -> dict[str, int]:
    """Envoy's non-zero overflow counters (a circuit breaker refused a request or a stream) and failed
    upstream connects (e.g. out of file descriptors)."""
    url = f"http://127.0.0.1:{stack.admin_port}/stats?filter=(overflow|connect_fail)$"
    text = http_client.get(url, timeout=5).text
    pairs = (line.split(": ", 1) for line in text.splitlines() if ": " in line)
    return {name: int(value) for name, value in pairs if value.isdigit() and int(value) > 0}


# The shipped config (routing filter + observer: two gRPC streams per request) and the lean shape (the
# routing filter alone; Envoy's access log ends each request: one stream per request).
SHAPES = {
    "shipped": StackOptions(),
    "lean": StackOptions(observer=False, access_log_flush_interval="0.01s"),
}


def start_stack(workdir: Path, streams: int, shape: str = "shipped") -> Stack:
    sim_args = (
        *("--ttft-ms", "5", "--itl-ms", "10", "--max-model-len", "1000000"),
        # every held stream runs at once, and the engines never look saturated to the picker
        *("--max-num-seqs", str(max(256, streams)), "--kv-capacity-tokens", "1000000000"),
    )
    workdir.mkdir(parents=True, exist_ok=True)
    options = dataclasses.replace(SHAPES[shape], replicas=3, sim_args=sim_args)
    return Stack(workdir, options).start()


# --- part 1: N live streams ----------------------------------------------------------------------------


class _HeldStream(asyncio.Protocol):
    """One streaming request kept open until the client closes it; `settled` resolves at its first
    token or its failure (a non-200 status, or the connection lost)."""

    def __init__(self, request: bytes, settled: asyncio.Future[None]) -> None:
        self._request, self.head, self.settled = request, b"", settled
        self.status, self.first, self.lost = 0, False, False
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self._request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if not self.status:
            self.head += data
            if b"\r\n" in self.head:
                self.status = int(self.head.split(b" ", 2)[1])
        if not self.first and b"data: " in data:
            self.first = True
        if self.first or self.status not in (0, 200):
            self._settle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._settle()

    def _settle(self) -> None:
        if not self.settled.done():
            self.settled.set_result(None)

    @property
    def live(self) -> bool:
        return self.first and not self.lost


async def open_batch(port: int, request: bytes, count: int, limit_s: float) -> list[_HeldStream]:
    """Open `count` streams at once; return once each has settled (or after `limit_s`)."""
    loop = asyncio.get_running_loop()
    streams = [_HeldStream(request, loop.create_future()) for _ in range(count)]

    async def connect(stream: _HeldStream) -> None:
        try:
            await loop.create_connection(lambda: stream, "127.0.0.1", port)
        except OSError:
            stream.connection_lost(None)

    await asyncio.gather(*(connect(s) for s in streams))
    await asyncio.wait([s.settled for s in streams], timeout=limit_s)
    return streams


def close_all(held: list[_HeldStream]) -> None:
    """The client goes away from every held stream (Envoy resets each upstream; the picker releases)."""
    for stream in held:
        if stream.transport is not None:
            stream.transport.close()


async def part_streams(workdir: Path, args: argparse.Namespace, shape: str) -> None:
    n = args.streams
    print(
        f"\n[memory with {n:,} live streams, {shape} config] one token every {args.hold_itl_ms / 1e3:.0f} s, "
        f"opened {args.batch} at a time ({load()})"
    )
    stack = await asyncio.to_thread(start_stack, workdir / f"streams-{shape}", n, shape)
    held: list[_HeldStream] = []
    try:
        assert stack.picker and stack.envoy and stack.sims
        pids = {"picker": stack.picker.pid, "envoy": stack.envoy.pid, "sims": stack.sims.pid}
        limits = ", ".join(f"{name} {max_open_files(pid)}" for name, pid in pids.items())
        print(f"  open-file limits: {limits}; Envoy needs ~{fds_needed(n):,}")
        await wait_in_flight(stack, lambda v: v == 0, 10, "an idle picker")
        idle = {name: rss(pid) for name, pid in pids.items()} | {"client": rss(os.getpid())}
        request = stream_request(HOLD_TOKENS, args.hold_itl_ms)
        started = time.monotonic()
        while len(held) < n and time.monotonic() - started < args.ramp_seconds:
            held += await open_batch(stack.listen_port, request, min(args.batch, n - len(held)), 60)
        live = [s for s in held if s.live]
        ramp = time.monotonic() - started
        statuses = Counter(s.status for s in held if not s.live)
        print(
            f"  opened {len(held):,} in {ramp:.1f} s: {len(live):,} streaming, {len(held) - len(live):,} "
            f"failed {dict(statuses) or ''}"
        )
        failure = next((s for s in held if not s.live and s.status), None)
        if failure is not None:  # what refused it: Envoy (flags in its headers) or the picker (reason)
            text = failure.head.decode(errors="replace")[:600]  # an error reply: Envoy's or the contract's
            print("  first failure: " + " | ".join(line for line in text.splitlines() if line))
        overflows = await asyncio.to_thread(envoy_overflows, stack)
        print(f"  Envoy overflows and failed connects: {overflows or 'none'}")
        if any(name.startswith("cluster.picker.") for name in overflows):
            print(
                "  ! the picker cluster's circuit breakers (Envoy's default 1024 requests) refused ext_proc "
                "streams: routing ones answer 503, observer ones fail open and leave their streams "
                "untracked, so the RSS below understates tracked streams"
            )
        value = await wait_in_flight(stack, lambda v: v >= len(live), 60, f"in-flight {len(live)}")
        now = {name: rss(pid) for name, pid in pids.items()} | {"client": rss(os.getpid())}
        print(f"  picker in-flight gauge {value:,.0f} ({load()})")
        print(f"  {'process':<7} | {'idle':>10} | {f'{len(live):,} streams':>14} | {'per stream':>10}")
        for name in ("picker", "envoy", "sims", "client"):
            per = (now[name] - idle[name]) / max(1, len(live))
            print(f"  {name:<7} | {mb(idle[name]):>10} | {mb(now[name]):>14} | {per:>8,.0f} B")
        at_goal = now["picker"] + (now["picker"] - idle["picker"]) / max(1, len(live)) * (10_000 - len(live))
        print(
            f"  goal: picker RSS <= {GOAL_MB} MB with 10,000 tracked streams: {now['picker'] / 1e6:.0f} MB "
            f"with {len(live):,}" + ("" if len(live) >= 10_000 else f" (~{at_goal / 1e6:.0f} MB at 10,000)")
        )
        before_close = await in_flight(stack)  # below the live count: some streams went untracked
        close_all(held)
        closing = time.monotonic()
        value = await wait_in_flight(stack, lambda v: v == 0, 120, "in-flight back to 0")
        after = {name: rss(pid) for name, pid in pids.items()}
        print(
            f"  in-flight {before_close:,.0f} just before the client closed every stream, {value:.0f} "
            f"{time.monotonic() - closing:.1f} s after; "
            f"RSS after: picker {after['picker'] / 1e6:.0f} MB, envoy {after['envoy'] / 1e6:.0f} MB"
        )
    finally:
        close_all(held)
        await asyncio.to_thread(stack.stop)


# --- part 2: the soak ----------------------------------------------------------------------------------


async def part_soak(workdir: Path, args: argparse.Namespace) -> None:
    count, seconds = args.soak_requests, args.soak_seconds
    rate = args.soak_rate if args.soak_rate >= 0 else count / (0.9 * seconds)
    print(
        f"\n[soak] {count:,} 8-token streams, at most {seconds:.0f} s, {args.soak_concurrency} clients"
        + (f" paced at {rate:.0f} req/s" if rate else " unpaced")
        + f" ({load()})"
    )
    stack = await asyncio.to_thread(start_stack, workdir / "soak", args.soak_concurrency)
    try:
        assert stack.picker and stack.envoy
        picker, envoy = stack.picker.pid, stack.envoy.pid
        request = stream_request(8)
        issued = done = failed = 0
        warm: Sample | None = None
        samples: list[Sample] = []
        cpu_before, started = cpu_seconds(picker), time.monotonic()
        stop_at = started + seconds

        def sample(value: float) -> Sample:
            return Sample(time.monotonic() - started, done, rss(picker), rss(envoy), value)

        async def worker() -> None:
            nonlocal issued, done, failed, warm
            while issued < count and time.monotonic() < stop_at:
                due = started + issued / rate if rate else 0.0
                issued += 1
                if due > time.monotonic():
                    await asyncio.sleep(due - time.monotonic())  # the pacing schedule
                result = await one_stream(stack.listen_port, request, 30)
                done += 1
                failed += not result.done
                if warm is None and done >= count * WARMUP_SHARE:
                    warm = sample(float("nan"))

        async def sampler() -> None:
            while True:
                await asyncio.sleep(args.sample_seconds)  # the sampling interval
                row = sample(await in_flight(stack))
                samples.append(row)
                print_row(row)

        async def pause_watch() -> None:  # a loop that should wake every 0.1 s: lateness = a pause
            nonlocal pauses, longest
            last = time.monotonic()
            while True:
                await asyncio.sleep(0.1)  # the watch's tick
                now = time.monotonic()
                if now - last > 0.6:
                    pauses, longest = pauses + 1, max(longest, now - last - 0.1)
                last = now

        print(f"  {'elapsed':>7} | {'done':>7} | {'picker RSS':>10} | {'envoy RSS':>10} | {'in-flight':>9}")
        first = sample(await in_flight(stack))
        samples.append(first)
        print_row(first)
        pauses, longest = 0, 0.0
        ticker, watch = asyncio.create_task(sampler()), asyncio.create_task(pause_watch())
        try:
            await asyncio.gather(*(worker() for _ in range(args.soak_concurrency)))
        finally:
            ticker.cancel()
            watch.cancel()
        wall = time.monotonic() - started
        cpu = cpu_seconds(picker) - cpu_before
        await wait_in_flight(stack, lambda v: v == 0, 30, "in-flight back to 0")
        end = sample(await in_flight(stack))
        samples.append(end)
        print_row(end)
        print(
            f"  {done:,} requests in {wall:.0f} s ({done / wall:.0f} req/s), {failed} failed; picker CPU "
            f"{cpu:.1f} s ({cpu / max(1, done) * 1e6:.0f} us per request) ({load()})"
        )
        ends = failed_ends(stack.access_log.read_text(errors="replace").splitlines())
        if ends:
            print(f"  not 200 in Envoy's access log: {dict(ends.most_common(5))}")
        if pauses:  # the whole machine stalled (seen with nothing running): timers fire late, requests fail
            print(f"  ! the client's loop paused {pauses} times over 0.5 s, the longest {longest:.1f} s")
        if warm is None:
            print(f"  fewer than {WARMUP_SHARE:.0%} of the requests ran: no growth figure")
            return
        grew, per_10k = growth(warm, end)
        after_warm = [s for s in samples if s.done >= warm.done]
        print(
            f"  picker RSS after warm-up ({warm.done:,} requests) {warm.picker_rss / 1e6:.1f} MB, at the end "
            f"{end.picker_rss / 1e6:.1f} MB: growth {grew:+.1f} MB ({per_10k:+.2f} MB per 10k requests; "
            f"fitted slope {slope_mb_per_10k([warm, *after_warm]):+.2f} MB per 10k)"
        )
        print(
            f"  envoy RSS {warm.envoy_rss / 1e6:.1f} -> {end.envoy_rss / 1e6:.1f} MB over the same span "
            "(the baseline: Envoy's own allocator settling)"
        )
        print("  goal: no growth over a 10-minute soak of 100k requests")
    finally:
        await asyncio.to_thread(stack.stop)


def print_row(row: Sample) -> None:
    print(
        f"  {row.elapsed:>6.0f}s | {row.done:>7,} | {mb(row.picker_rss):>10} | {mb(row.envoy_rss):>10} | "
        f"{row.in_flight:>9.0f}",
        flush=True,
    )


# --- main ------------------------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> None:
    parts = args.parts.split(",")
    print(f"bench_soak on {os.cpu_count()} cores, {load()} at start")
    print(f"  {raise_open_files(fds_needed(args.streams) if 'streams' in parts else 0)}")
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        if "streams" in parts:
            for shape in args.shapes.split(","):
                await part_streams(Path(tmp), args, shape)
        if "soak" in parts:
            await part_soak(Path(tmp), args)
    print(
        f"\nclient max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB; {load()} at end"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default="streams,soak")
    parser.add_argument("--streams", type=int, default=10_000, help="live streams of the memory part")
    parser.add_argument("--shapes", default="shipped,lean", help=f"memory part configs: {', '.join(SHAPES)}")
    parser.add_argument("--batch", type=int, default=500, help="streams opened at a time")
    parser.add_argument("--hold-itl-ms", type=int, default=10_000, help="token interval of held streams")
    parser.add_argument("--ramp-seconds", type=float, default=300, help="bound of the ramp-up")
    parser.add_argument("--soak-requests", type=int, default=100_000)
    parser.add_argument("--soak-seconds", type=float, default=600)
    parser.add_argument("--soak-concurrency", type=int, default=32)
    parser.add_argument(
        "--soak-rate", type=float, default=-1, help="req/s (0: unpaced; default: requests / (0.9 x seconds))"
    )
    parser.add_argument("--sample-seconds", type=float, default=10)
    args = parser.parse_args()
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
