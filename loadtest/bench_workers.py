"""Benchmark: N picker processes in one pod (`picker serve --workers N`, issue 56 item 4), each pinned
to a core, against one, in one run: how far a pod's ceiling rises where cores are spare.

Rows, in interleaved rounds (a fresh pod each round):
  1 worker @0        `picker serve` (one process), pinned to CPU 0; the load pinned to CPU 1
  2 workers @0       `--workers 2`, both pinned to CPU 0; the load on CPU 1: what splitting one core
                     between two peers costs (the peer channel, two event loops, two gRPC stacks)
  2 workers @0,1     `--workers 2`, one pinned to each CPU; the load unpinned, on both
The load: --clients processes, each with --connections gRPC channels (each its own TCP connection,
so the kernel's SO_REUSEPORT hash places each on one worker for its life, as it would Envoy's) and
--concurrency closed loops sending, per request, what Envoy's shipped config sends: the routing
stream (request headers, the buffered body; answered) and then the observer stream (response
headers, eight SSE chunks) on the same connection (loadtest/bench_hot_path.py builds both).
Printed per row: requests/s in the measured window; the workers' CPU (/proc, all threads, summed
over workers) per request and as a share of their cores; the clients' CPU per request; how the
connections and the picks split over the workers; and the books: each worker's view of the pod's
requests in flight during the window (its own plus its peer's, sampled), and after the load
whether every worker's own and peer counts came back to 0.

THIS MACHINE: 2 cores, shared by the load generator, which costs about as much CPU per request as
the picker (Python gRPC on both sides). So the 2-worker row on two cores shares them with the load
and cannot show a pod's ceiling where cores are spare; the 1-worker row's ceiling is the picker's
only while its core is saturated (the CPU share column says whether it was). On a box with spare
cores, pin the load elsewhere (`--client-cpus 2,3`); the workers stay on CPUs 0 and 1.
Bounded: --rounds x 3 rows x (start + --warmup + --seconds + stop), about 2 minutes by default.
Run: `python -m loadtest.bench_workers [--rounds 2 --seconds 8]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import http_client
from loadtest.procs import Proc, free_port, wait_until
from loadtest.rawclient import cpu_seconds
from loadtest.stack import parse_metrics, picker_ready, serve_argv

ENDPOINTS = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000")  # never connected to (--no-scrape)


@dataclass(frozen=True)
class Row:
    name: str
    workers: int
    worker_cpus: tuple[int, ...]  # worker i pinned to worker_cpus[i]
    client_cpus: tuple[int, ...] | None  # None: unpinned


ROWS = (
    Row("1 worker @0", 1, (0,), (1,)),
    Row("2 workers @0", 2, (0, 0), (1,)),
    Row("2 workers @0,1", 2, (0, 1), None),
)


# --- the load: one client process --------------------------------------------------------------


async def client(port: int, connections: int, concurrency: int, seconds: float) -> dict[str, object]:
    """Connect, send one request per connection (so the picker has seen each one's observer), say
    `ready`, read the window's start (a monotonic time) from stdin, then run closed loops to its end;
    what is counted is what ended inside the window."""
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from loadtest.bench_hot_path import _feed, _routed, observer_messages, routing_messages

    options = [("grpc.use_local_subchannel_pool", 1)]  # each channel its own connection
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) for _ in range(connections)]
    stubs = [ep_grpc.ExternalProcessorStub(channel) for channel in channels]
    metadata = (("x-picker-data-plane", "override-host"),)
    numbers = itertools.count(os.getpid() * 1_000_000)
    counts = {"done": 0, "errors": 0}
    failures: dict[str, None] = {}

    async def one(stub: ep_grpc.ExternalProcessorStub) -> None:
        number = next(numbers)
        try:
            answers = [a async for a in stub.Process(_feed(routing_messages(number)), metadata=metadata)]
        except grpc.aio.AioRpcError as exc:
            raise RuntimeError(f"routing: {exc.details()}") from exc
        request_id, served = _routed(answers[-1])
        messages = observer_messages(request_id, served, number)
        sent = [0]

        async def feed() -> AsyncIterator[object]:
            for message in messages:
                yield message
                sent[0] += 1

        try:
            async for _ in stub.Process(feed(), metadata=metadata):
                pass
        except grpc.aio.AioRpcError:
            # the picker ends the observer's RPC at the stream's end; the client's half-close may
            # then find it finished (Envoy's does not mind): every message was delivered
            if sent[0] < len(messages):
                raise RuntimeError(f"observer after {sent[0]} of {len(messages)}") from None

    for channel, stub in zip(channels, stubs, strict=True):
        await channel.channel_ready()
        with contextlib.suppress(grpc.aio.AioRpcError, RuntimeError):
            await one(stub)  # before its first observer, a connection's routing stream stays open
    print("ready", flush=True)
    start_at = float(await asyncio.to_thread(sys.stdin.readline))
    end = start_at + seconds
    cpu: list[float] = []

    async def loop(index: int) -> None:
        stub = stubs[index % connections]
        while time.monotonic() < end:
            try:
                await one(stub)
            except (grpc.aio.AioRpcError, KeyError, IndexError, RuntimeError) as exc:
                if start_at <= time.monotonic() < end:
                    counts["errors"] += 1
                    failures.setdefault(repr(exc)[:300], None)
                continue
            if start_at <= time.monotonic() < end:
                counts["done"] += 1

    async def window() -> None:
        await asyncio.sleep(max(0.0, start_at - time.monotonic()))
        cpu.append(time.process_time())
        await asyncio.sleep(max(0.0, end - time.monotonic()))
        cpu.append(time.process_time())

    await asyncio.gather(window(), *(loop(i) for i in range(concurrency)))
    for channel in channels:
        await channel.close()
    return {**counts, "cpu": cpu[1] - cpu[0], "failures": list(failures)[:3]}


def client_main(args: argparse.Namespace) -> None:
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # before gRPC starts threads
    import uvloop

    result = uvloop.run(client(args.port, args.connections, args.concurrency, args.seconds))
    print(json.dumps(result), flush=True)


# --- the pod ------------------------------------------------------------------------------------


def pin(pid: int, cpu: int) -> None:
    """Every thread of `pid` to `cpu` (sched_setaffinity on a PID moves its main thread alone)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), {cpu})
        except ProcessLookupError:
            pass


def worker_pids(pod: Proc, workers: int) -> list[int]:
    """The processes that serve: the picker itself, or its workers (the parent's children)."""
    if workers == 1:
        return [pod.pid]
    children = Path(f"/proc/{pod.pid}/task/{pod.pid}/children").read_text().split()
    assert len(children) == workers, children
    return [int(pid) for pid in children]


def connections_of(pids: list[int], port: int) -> list[int]:
    """Established connections on the ext_proc port each worker holds (/proc/net/tcp*, fds)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            parts = line.split()
            if int(parts[1].rsplit(":", 1)[1], 16) == port and parts[3] == "01":  # ESTABLISHED
                inodes.add(parts[9])
    counts = []
    for pid in pids:
        held = 0
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            held += target.startswith("socket:[") and target[8:-1] in inodes
        counts.append(held)
    return counts


def books(metrics_ports: list[int]) -> list[tuple[float, float, float]]:
    """Per worker: (its own requests in flight, its peers' as it counts them, its picks so far)."""
    out = []
    for port in metrics_ports:
        samples = parse_metrics(http_client.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
        total = {
            "picker_endpoint_in_flight": 0.0,
            "picker_endpoint_peer_in_flight": 0.0,
            "picker_picks_total": 0.0,
        }
        for (name, _), value in samples.items():
            if name in total:
                total[name] += value
        out.append(tuple(total.values()))  # type: ignore[arg-type]
    return out  # type: ignore[return-value]


def _in_flight(metrics_ports: list[int]) -> float:
    return sum(own + peer for own, peer, _ in books(metrics_ports))


@dataclass
class Result:
    row: Row
    rps: float
    worker_cpu_ms: float  # per request, summed over workers
    worker_share: float  # of the workers' cores
    client_cpu_ms: float
    connections: list[int]
    picks: list[float]
    views: list[float] = field(default_factory=list)  # each worker's mean view of the pod's in flight
    truth: float = 0.0  # mean of the sum of own counts, at the same samples
    at_rest: float = 0.0  # every count, own and peers', summed after the load


def run_row(row: Row, args: argparse.Namespace, workdir: Path) -> Result:
    grpc_port, health = free_port(), free_port()
    metrics, peers = free_port(paired=1), free_port(paired=1)
    argv = serve_argv(
        grpc_port, health, metrics, "--workers", str(row.workers), "--endpoints", ",".join(ENDPOINTS)
    )
    argv += ["--secure-serving=false", "--no-scrape", "--peer-port", str(peers), "--log-level", "WARNING"]
    argv += ["--quiet-interval", "0.2", "--propagation", "0.5"]
    pod = Proc("picker", argv, workdir / f"picker-{row.workers}-{time.monotonic_ns()}.log")
    clients: list[subprocess.Popen[str]] = []
    try:
        wait_until(lambda: picker_ready(health), 30, what=f"{row.name} ready")
        wait_until(lambda: pod.log_text().count("picker ready") == row.workers, 30, what="every worker")
        pids = worker_pids(pod, row.workers)
        for pid, cpu in zip(pids, row.worker_cpus, strict=True):
            pin(pid, cpu)
        metrics_ports = [metrics + i for i in range(row.workers)]
        for _ in range(args.clients):
            argv = [sys.executable, "-m", "loadtest.bench_workers", "--client", "--port", str(grpc_port)]
            argv += ["--connections", str(args.connections), "--concurrency", str(args.concurrency)]
            argv += ["--seconds", str(args.seconds)]
            cpus = args.client_cpus or (",".join(map(str, row.client_cpus)) if row.client_cpus else "")
            argv += ["--cpus", cpus] if cpus else []
            clients.append(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for c in clients:
            assert c.stdout is not None and c.stdin is not None
            if c.stdout.readline().strip() != "ready":  # blocks until connected and primed
                raise RuntimeError(f"a load process failed to start ({c.wait(10)})")
        start_at = time.monotonic() + args.warmup
        for c in clients:
            assert c.stdin is not None
            c.stdin.write(f"{start_at!r}\n")
            c.stdin.close()
        time.sleep(max(0.0, start_at - time.monotonic()))  # the window's start: a measurement point
        for pid, cpu in zip(pids, row.worker_cpus, strict=True):
            pin(pid, cpu)  # threads gRPC started under load
        connections = connections_of(pids, grpc_port)
        cpu_before = sum(cpu_seconds(pid) for pid in pids)
        picks_before = [p for _, _, p in books(metrics_ports)]
        samples: list[list[tuple[float, float, float]]] = []
        while time.monotonic() < start_at + args.seconds - 0.5:
            samples.append(books(metrics_ports))
            time.sleep(1.0)  # a sample a second: each costs the workers a scrape
        time.sleep(max(0.0, start_at + args.seconds - time.monotonic()))
        cpu = sum(cpu_seconds(pid) for pid in pids) - cpu_before
        picks = [p - b for (_, _, p), b in zip(books(metrics_ports), picks_before, strict=True)]
        reports = [json.loads(c.stdout.read()) for c in clients if c.stdout is not None]
        for c in clients:
            c.wait(30)
        done = sum(r["done"] for r in reports)
        try:
            wait_until(lambda: _in_flight(metrics_ports) == 0, 10, what="books at rest")
        except TimeoutError:
            pass  # reported: NOT 0
        result = Result(
            row,
            rps=done / args.seconds,
            worker_cpu_ms=cpu * 1e3 / max(done, 1),
            worker_share=cpu / args.seconds / len(set(row.worker_cpus)),
            client_cpu_ms=sum(r["cpu"] for r in reports) * 1e3 / max(done, 1),
            connections=connections,
            picks=picks,
        )
        if samples and row.workers > 1:
            result.truth = statistics.fmean(sum(own for own, _, _ in s) for s in samples)
            result.views = [statistics.fmean(s[i][0] + s[i][1] for s in samples) for i in range(row.workers)]
        result.at_rest = _in_flight(metrics_ports)
        errors = sum(r["errors"] for r in reports)
        if errors:
            print(
                f"  {row.name}: {errors} requests failed: {sorted({f for r in reports for f in r['failures']})}",  # noqa: E501
                flush=True,
            )
        return result
    finally:
        for c in clients:
            if c.poll() is None:
                c.kill()
                c.wait(5)
        pod.stop()


def report(results: list[Result]) -> None:
    print(
        f"{'row':<16}{'req/s':>8}{'picker ms/req':>15}{'picker cores':>14}{'client ms/req':>15}"
        f"  connections / picks per worker   books: each worker's view of in flight (sum of own)"
    )
    for row in ROWS:
        mine = [r for r in results if r.row == row]
        if not mine:
            continue
        rps = statistics.median(r.rps for r in mine)
        cpu = statistics.median(r.worker_cpu_ms for r in mine)
        share = statistics.median(r.worker_share for r in mine) * len(set(row.worker_cpus))
        client_ms = statistics.median(r.client_cpu_ms for r in mine)
        split = "; ".join(
            "/".join(str(c) for c in r.connections) + " conn, " + "/".join(f"{p:.0f}" for p in r.picks)
            for r in mine
        )
        views = (
            "; ".join(", ".join(f"{v:.1f}" for v in r.views) + f" ({r.truth:.1f})" for r in mine if r.views)
            or "-"
        )
        print(f"{row.name:<16}{rps:>8.0f}{cpu:>15.2f}{share:>14.2f}{client_ms:>15.2f}  {split}   {views}")
    print(f"books at rest after each round: {'all 0' if all(r.at_rest == 0 for r in results) else 'NOT 0'}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0, help="measured window per round and row")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--clients", type=int, default=2, help="load processes")
    parser.add_argument("--connections", type=int, default=8, help="gRPC connections per load process")
    parser.add_argument("--concurrency", type=int, default=24, help="closed loops per load process")
    parser.add_argument(
        "--client-cpus", help="pin the load here in every row, e.g. 2,3 (default: CPU 1, or unpinned)"
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--cpus", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        client_main(args)
        return
    if not 1 <= args.rounds <= 5 or not 1 <= args.seconds <= 30:
        parser.error("--rounds 1-5 and --seconds 1-30 keep a run under 5 minutes")
    if len(os.sched_getaffinity(0)) < 2:
        parser.error("needs CPUs 0 and 1")
    print(
        f"bench_workers: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.clients} load processes "
        f"x {args.connections} connections x {args.concurrency} loops; {args.seconds:.0f} s a row, "
        f"{args.rounds} rounds",
        flush=True,
    )
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        for round_ in range(args.rounds):
            for row in ROWS:
                result = run_row(row, args, Path(tmp))
                results.append(result)
                print(
                    f"  round {round_ + 1} {row.name}: {result.rps:.0f} req/s, "
                    f"{result.worker_cpu_ms:.2f} ms picker CPU/req",
                    flush=True,
                )
    report(results)


if __name__ == "__main__":
    main()
