"""A flood of strangers on a picker's peer port (issue 53): the picker's memory, and routing meanwhile.

Two pickers with one set of books (peers on, plaintext Envoy hop) behind Envoy, over 3 simulated
replicas; picker 0 is attacked. Every phase runs the same routing load through Envoy (8-token
streams, closed loop, 20 concurrent, 20 s); the rows:
  baseline        no flood
  flood 1 src     1,000 connections to picker 0's peer port from 127.0.0.1 (its cap per address, 8, binds)
  flood 125 src   the same from 125 loopback source addresses (127.0.1.1-125, 8 slots each), so that
                  the cap on all unauthenticated connections (64) binds too; run twice (--repeat): RSS
                  that kept growing from one run to the next would be a leak
The flood is a child process (uvloop) with 1,000 slots: each connects and writes as fast as the
socket takes it (a msgpack bin32 header announcing 16 MiB, then zeros: never a whole hello), and
when the picker closes it (counted as refused) connects again, until the slot has written 16 MiB
(16 GB in all), 20 s have passed or 2,000 attempts. Only client sockets bind those other loopback
addresses; every listener is on 127.0.0.1. Its RLIMIT_NOFILE is raised to 1,064 if lower (said).

Columns: attempts (the flood's connects), at accept / accepted (picker 0's own count of connections
it closed unread, at its caps, and of those it read up to its hello limit and closed), open (still
open when the flood stopped, most waiting in the listen backlog), GB handed to the client's kernel;
served / failed streams and TTFT p50/p99 of those started while the flood ran (the whole phase for
the baseline); picker 0's VmRSS (before, peak of 0.1 s samples, 3 s after), VmHWM, open descriptors
and CPU; `link`: the fewest peers either picker had connected (0.5 s samples); probe: each picker's
slowest /metrics answer (served on its event loop: picker 1, not attacked, is the control). Below:
`picker_peer_connections_rejected_total` by reason, requests each picker admitted, the load average;
then, with 24 long streams in flight, each picker's books per replica (own + peers' in flight) beside
what the replica runs. Goal: RSS peak < 50 MB over the baseline's, requests served, link up, books agree.

Run: `python -m loadtest.bench_peer_flood` (about 110 s). Prints one table, a few lines, a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import struct
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from subprocess import PIPE
from typing import Any

from loadtest import http_client
from loadtest.bench_cost import closed_loop, load, one_stream, stream_request, ttfts
from loadtest.procs import wait_until
from loadtest.rawclient import cpu_seconds
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import percentile

MIB = 1024 * 1024
CHUNK = 256 * 1024
MAX_ATTEMPTS = 2000  # connections per slot, at most
REJECTED = "picker_peer_connections_rejected_total"
AT_ACCEPT = ("too-many-from-source", "too-many-unauthenticated", "accept-failed")  # closed unread
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# --- the flood (a child process) ---------------------------------------------------------------------


def raise_nofile(need: int) -> str:
    """This process's RLIMIT_NOFILE raised to `need` (up to the hard limit) if below; what was done."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return f"RLIMIT_NOFILE {soft} (no raise needed)"
    new = need if hard == resource.RLIM_INFINITY else min(need, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
    return f"RLIMIT_NOFILE raised {soft} -> {new}"


async def one_connection(source: str, port: int, budget: int, deadline: float, stats: Counter[str]) -> int:
    """Connect from `source` and write up to `budget` bytes as fast as the socket takes them: bytes sent."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    # our own close (budget spent, deadline) is a reset: no TIME_WAIT left on a machine others share
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    chunk = struct.pack(">BI", 0xC6, 16 * MIB) + bytes(CHUNK - 5)  # a bin32 of 16 MiB: never a whole message
    zeros = bytes(CHUNK)
    sent, connected = 0, False
    try:
        sock.bind((source, 0))
        async with asyncio.timeout_at(deadline):
            await loop.sock_connect(sock, ("127.0.0.1", port))
            connected = True
            stats["connected"] += 1
            while sent < budget:
                await loop.sock_sendall(sock, chunk)
                sent += len(chunk)
                stats["bytes"] += len(chunk)
                chunk = zeros
            stats["budget spent"] += 1
    except TimeoutError:
        stats["open at end" if connected else "connect timed out"] += 1
    except (ConnectionResetError, BrokenPipeError):
        stats["closed by picker"] += 1
    except OSError as exc:
        stats[f"connect {type(exc).__name__}" if not connected else f"error {type(exc).__name__}"] += 1
        await asyncio.sleep(0.05)  # no spinning on a listener that is gone
    finally:
        sock.close()
    return sent


async def flood(port: int, sources: list[str], slots: int, seconds: float, per_slot: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    stats: Counter[str] = Counter()

    async def slot(source: str) -> None:
        spent = attempts = 0
        while spent < per_slot and attempts < MAX_ATTEMPTS and loop.time() < deadline:
            attempts += 1
            stats["attempts"] += 1
            spent += await one_connection(source, port, per_slot - spent, deadline, stats)

    started, cpu = time.monotonic(), time.process_time()
    await asyncio.gather(*(slot(sources[i % len(sources)]) for i in range(slots)))
    return {**stats, "seconds": time.monotonic() - started, "cpu_s": time.process_time() - cpu}


def flood_child(argv: list[str]) -> None:
    import uvloop

    port, sources, slots, seconds, per_slot = argv
    note = raise_nofile(int(slots) + 64)
    print(json.dumps({"ready": note}), flush=True)
    figures = uvloop.run(flood(int(port), sources.split(","), int(slots), float(seconds), int(per_slot)))
    print(json.dumps(figures), flush=True)


# --- measuring picker 0 ------------------------------------------------------------------------------


def vm(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5]] = int(line.split()[1]) * 1024
    return out["VmRSS"], out["VmHWM"]


def timed_scrape(port: int) -> tuple[float, Samples]:
    """(ms the picker took to answer, its metrics): its /metrics is served on its event loop (aiohttp)."""
    started = time.perf_counter()
    text = http_client.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    return (time.perf_counter() - started) * 1e3, parse_metrics(text)


def by_name(samples: Samples, name: str) -> dict[str, float]:
    """One family's samples keyed by their labels' values joined (e.g. the reason)."""
    return {",".join(v for _, v in labels): value for (n, labels), value in samples.items() if n == name}


@dataclass
class Row:
    name: str
    flood: dict[str, object] = field(default_factory=dict)
    window_s: float = 0.0  # the streams counted: started in this window (the flood's; else the phase)
    served: int = 0
    failed: int = 0
    ttft_p50_ms: float = float("nan")
    ttft_p99_ms: float = float("nan")
    rss_before_mb: float = 0.0
    rss_peak_mb: float = 0.0
    rss_after_mb: float = 0.0
    hwm_mb: float = 0.0
    fds_peak: int = 0
    picker_cpu_pct: float = 0.0
    admitted: list[float] = field(default_factory=list)  # requests each picker admitted in the phase
    probe_ms: list[float] = field(default_factory=list)  # each picker's slowest /metrics answer
    load: str = ""
    link_min: float = 0.0  # fewest peers connected, on either picker, over the phase
    scrapes_failed: int = 0
    rejected: dict[str, float] = field(default_factory=dict)


class Sampler:
    """Picker 0's RSS and descriptors every 0.1 s; every 0.5 s both pickers' link, and how long each
    takes to answer /metrics (a probe of its event loop; picker 1, not attacked, is the control)."""

    def __init__(self, stack: Stack) -> None:
        assert stack.picker is not None
        self.stack, self.pid = stack, stack.picker.pid
        self.rss: list[int] = []
        self.fds: list[int] = []
        self.links: list[float] = []
        self.probes: list[list[float]] = [[] for _ in stack.picker_ports]
        self.failed = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        tick = 0
        while not self._stop.is_set():
            self.rss.append(vm(self.pid)[0])
            self.fds.append(len(os.listdir(f"/proc/{self.pid}/fd")))
            if tick % 5 == 0:
                for index, (_, _, metrics) in enumerate(self.stack.picker_ports):
                    try:
                        took, samples = await asyncio.to_thread(timed_scrape, metrics)
                        self.probes[index].append(took)
                        self.links.append(samples.get(("picker_peers_connected", ()), 0.0))
                    except Exception:
                        self.failed += 1
            tick += 1
            try:
                await asyncio.wait_for(self._stop.wait(), 0.1)  # the sampling period
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stop.set()


async def phase(stack: Stack, row: Row, sources: list[str] | None, args: argparse.Namespace) -> Row:
    assert stack.picker is not None and stack.peer_ports
    pid = stack.picker.pid
    before = [timed_scrape(metrics)[1] for _, _, metrics in stack.picker_ports]
    row.rss_before_mb = vm(pid)[0] / 1e6
    sampler = Sampler(stack)
    sampling = asyncio.create_task(sampler.run())
    child: asyncio.subprocess.Process | None = None
    over: asyncio.Task[bytes] | None = None
    window = [time.perf_counter(), 0.0]  # the streams counted started in it (perf_counter, as theirs)
    cpu = [cpu_seconds(pid), 0.0]

    async def flood_over(child: asyncio.subprocess.Process) -> bytes:
        assert child.stdout is not None
        out = await child.stdout.read()  # to its end: the flood is over
        window[1], cpu[1] = time.perf_counter(), cpu_seconds(pid)
        return out

    try:
        if sources is not None:
            argv = ["-m", "loadtest.bench_peer_flood", "--flood-child", str(stack.peer_ports[0])]
            argv += [",".join(sources), str(args.connections), str(args.seconds), str(args.mib * MIB)]
            child = await asyncio.create_subprocess_exec(sys.executable, *argv, stdout=PIPE)
            assert child.stdout is not None
            row.flood["nofile"] = json.loads(await child.stdout.readline())["ready"]
            window[0], cpu[0] = time.perf_counter(), cpu_seconds(pid)
            over = asyncio.create_task(flood_over(child))
        request = stream_request(8)
        results, _ = await closed_loop(stack.listen_port, request, args.concurrency, 100_000, args.seconds)
        if child is None or over is None:
            window[1], cpu[1] = time.perf_counter(), cpu_seconds(pid)
        else:
            out = await asyncio.wait_for(over, args.seconds + 30)
            await asyncio.wait_for(child.wait(), 10)
            row.flood.update(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        if child is not None and child.returncode is None:
            child.kill()  # by its PID, should it outlive its own deadline
            await child.wait()
        sampler.stop()
        await sampling
    row.window_s = window[1] - window[0]
    row.picker_cpu_pct = (cpu[1] - cpu[0]) / row.window_s * 100
    counted = [r for r in results if window[0] <= r.started <= window[1]]
    got = ttfts(counted)
    row.served, row.failed = len(got), len(counted) - len(got)
    row.ttft_p50_ms, row.ttft_p99_ms = percentile(got, 50) * 1e3, percentile(got, 99) * 1e3
    await asyncio.sleep(3)  # a measurement point after the flood, not a synchronisation
    after = [timed_scrape(metrics)[1] for _, _, metrics in stack.picker_ports]
    row.rss_peak_mb, row.fds_peak = max(sampler.rss) / 1e6, max(sampler.fds)
    row.rss_after_mb, hwm = (v / 1e6 for v in vm(pid))
    row.hwm_mb = hwm
    row.link_min, row.scrapes_failed = min(sampler.links, default=float("nan")), sampler.failed
    row.probe_ms = [max(probes, default=float("nan")) for probes in sampler.probes]
    old = by_name(before[0], REJECTED)
    row.rejected = {
        k: v - old.get(k, 0.0) for k, v in by_name(after[0], REJECTED).items() if v > old.get(k, 0.0)
    }
    admitted = [sum(by_name(samples, "picker_requests_total").values()) for samples in (*before, *after)]
    row.admitted = [b - a for a, b in zip(admitted[: len(before)], admitted[len(before) :], strict=True)]
    row.load = load()
    return row


async def books(stack: Stack, streams: int = 24, tokens: int = 200) -> dict[str, list[float]]:
    """Per replica, with `streams` long streams in flight: [picker 0's view (own + peers'), picker 1's,
    what the replica runs]."""
    prompts = [f"books check {i} " * 8 for i in range(streams)]  # spread over the replicas
    requests = [stream_request(tokens, 25, prompt=prompt) for prompt in prompts]
    tasks = [
        asyncio.create_task(one_stream(stack.listen_port, request, tokens * 0.025 + 30))
        for request in requests
    ]
    try:
        started = lambda: stack.sim_value("vllm:num_requests_running") >= streams  # noqa: E731
        await asyncio.to_thread(wait_until, started, 10, 0.05, "every long stream running")
        await asyncio.sleep(2.5)  # past the 2 s observer grace (tests/envoy/test_two_pickers_books.py)
        views = [(await asyncio.to_thread(timed_scrape, metrics))[1] for _, _, metrics in stack.picker_ports]
        out = {}
        for replica in stack.replicas:
            label = (("endpoint", replica),)
            seen = [v.get(("picker_endpoint_in_flight", label), 0.0) for v in views]
            peers = [v.get(("picker_endpoint_peer_in_flight", label), 0.0) for v in views]
            engine = parse_metrics(http_client.get(f"http://{replica}/metrics", timeout=5).text)
            running = sum(v for (n, _), v in engine.items() if n == "vllm:num_requests_running")
            out[replica] = [seen[0] + peers[0], seen[1] + peers[1], running]
        return out
    finally:
        await asyncio.gather(*tasks)


# --- the report ----------------------------------------------------------------------------------------


def print_table(rows: list[Row]) -> None:
    names = ["phase", "window s", "attempts", "at accept", "accepted", "open", "GB sent", "served", "fail"]
    names += ["TTFT p50", "p99 ms", "RSS MB before/peak/after", "HWM MB", "fds", "CPU %", "link"]
    names += ["probe ms 0/1"]
    lines = [names]
    for r in rows:
        f: dict[str, Any] = r.flood
        at_accept = sum(v for k, v in r.rejected.items() if k in AT_ACCEPT)
        closed = sum(r.rejected.values()) - at_accept
        counts = [f.get("attempts", 0), at_accept, closed, f.get("open at end", 0)]
        flood = [*(f"{n:.0f}" for n in counts), f"{f.get('bytes', 0) / 1e9:.2f}"] if f else ["-"] * 5
        rss = f"{r.rss_before_mb:.1f} / {r.rss_peak_mb:.1f} / {r.rss_after_mb:.1f}"
        routed = [str(r.served), str(r.failed), f"{r.ttft_p50_ms:.1f}", f"{r.ttft_p99_ms:.1f}"]
        picker = [rss, f"{r.hwm_mb:.1f}", str(r.fds_peak), f"{r.picker_cpu_pct:.0f}", f"{r.link_min:.0f}"]
        picker.append(" / ".join(f"{ms:.0f}" for ms in r.probe_ms))
        lines.append([r.name, f"{r.window_s:.1f}", *flood, *routed, *picker])
    widths = [max(len(line[i]) for line in lines) for i in range(len(names))]
    for index, line in enumerate(lines):
        cells = [line[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(line[1:], widths[1:], strict=True))]
        print(" | ".join(cells))
        if index == 0:
            print("-+-".join("-" * w for w in widths))


def report(args: argparse.Namespace, rows: list[Row], agree: dict[str, list[float]], notes: str) -> None:
    print(
        f"\n{args.connections:,} flood slots x {args.mib} MiB, {args.seconds:.0f} s per phase; routing: "
        f"8-token streams via Envoy, closed loop at {args.concurrency}; picker 0 attacked ({load()} at end)"
    )
    print_table(rows)
    growth = max(r.rss_peak_mb for r in rows[1:]) - rows[0].rss_peak_mb
    for r in rows:
        f: dict[str, Any] = r.flood
        other = {k: v for k, v in f.items() if k.startswith(("connect ", "error", "budget"))}
        admitted = " / ".join(f"{n:.0f}" for n in r.admitted)
        line = f"  {r.name}: admitted by picker 0 / 1: {admitted}; {r.load} at its end"
        if f:
            line += (
                f"; picker 0 refused {dict(sorted(r.rejected.items()))}; flood client "
                f"{f.get('cpu_s', 0):.1f} CPU-s over {f.get('seconds', 0):.1f} s, "
                f"connected {f.get('connected', 0)}, other {other}"
            )
        print(line)
    exact = all(v[0] == v[1] == v[2] for v in agree.values())
    shown = {k: [int(x) for x in v] for k, v in agree.items()}
    print(f"  books after, 24 streams in flight (picker 0 / picker 1 / replica): {shown}: ", end="")
    print("agree" if exact else "DISAGREE")
    print(f"  {notes}")
    ok = growth < 50 and all(r.served > 0 and r.link_min >= 1 for r in rows) and exact
    print(
        f"  goal: RSS peak under flood - baseline peak = {growth:+.1f} MB (< 50), routing on and the link "
        f"up in every phase, books agree: {'met' if ok else 'NOT met'}"
    )
    figures = {"rows": [asdict(r) for r in rows], "books": agree, "rss_growth_mb": growth, "goal_met": ok}
    print(json.dumps(figures))


async def run(args: argparse.Namespace) -> None:
    print(f"bench_peer_flood on {os.cpu_count()} cores, {load()} at start")
    many = [f"127.0.1.{i}" for i in range(1, args.sources + 1)]
    with tempfile.TemporaryDirectory(prefix="bench-peer-flood-") as tmp:
        options = StackOptions(replicas=3, pickers=2, peers=True, envoy_picker_tls=False)
        stack = Stack(Path(tmp), options)
        await asyncio.to_thread(stack.start)
        try:
            assert stack.picker is not None
            rows = [await phase(stack, Row("baseline"), None, args)]
            rows.append(await phase(stack, Row("flood 1 src"), ["127.0.0.1"], args))
            for index in range(args.repeat):  # again: RSS that keeps growing would be a leak
                name = f"flood {len(many)} src" + (f" #{index + 1}" if index else "")
                rows.append(await phase(stack, Row(name), many, args))
            agree = await books(stack)
            alive = [p is not None and p.alive() for p in stack.pickers]  # before stop()
            log = stack.picker.log_text()
        except BaseException:
            if stack.picker is not None:  # the evidence, before the work directory goes
                print(f"picker 0's log, its end:\n{stack.picker.log_text()[-4000:]}", file=sys.stderr)
            raise
        finally:
            await asyncio.to_thread(stack.stop)
    lives = ", ".join(f"picker {i} {'alive' if a else 'DEAD'}" for i, a in enumerate(alive))
    flood_note = rows[1].flood.get("nofile", "")
    notes = f"{lives}; tracebacks in picker 0's log: {log.count('Traceback')}; flood client: {flood_note}"
    report(args, rows, agree, notes)


def main() -> None:
    if sys.argv[1:2] == ["--flood-child"]:
        flood_child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--connections", type=int, default=1000, help="flood slots, each its own connection")
    parser.add_argument("--mib", type=int, default=16, help="what each slot tries to write")
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase (and the flood's bound)")
    parser.add_argument(
        "--sources", type=int, default=125, help="loopback source addresses of the last phase"
    )
    parser.add_argument("--repeat", type=int, default=2, help="runs of the many-source flood")
    parser.add_argument("--concurrency", type=int, default=20, help="routing load: closed-loop streams")
    args = parser.parse_args()
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
