"""Benchmark: two real vLLM replicas (CPU build) behind Envoy round robin vs Envoy + picker (issue 15).

One run replays the same seeded open-loop Poisson load of streaming completions through each setup:
  rr         Envoy alone, round robin (the picker's Envoy config without ext_proc)
  picker     Envoy + picker, shipped flags (scraping every 100 ms, flow control on)
  noscrape   Envoy + picker --no-scrape (in-flight counts only; flow control then never queues)
  noflow     Envoy + picker, scraping on, --waiting-threshold 1e9 (nothing is ever held in the picker)
  scrape500  Envoy + picker, scraping every 500 ms instead of 100 ms (not in the default run)
Each picker setup runs its own Envoy + picker only while it is measured (an idle picker scrapes the
engines, whose API servers pay for every scrape), against the same two vLLMs, started once and
pinned one core each (VLLM_CPU_OMP_THREADS_BIND), or, with `--router-core N --cores M,M`, both
vLLM servers (every process) on the other cores and Envoy, the picker and the client on core N:
the picker with a core of its own, away from the engines. Per setup: tokens/s, completed, TTFT p50/p99,
requests the picker held and for how long, CPU seconds of the picker, Envoy, both engines (every
process of each server) and the client, and the load average. Bounded: the arrival list is finite
and every stream has a read deadline; about 5 minutes with both vLLM starts (two rounds).
Run: `python -m loadtest.bench_realvllm` (needs `make real-vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from loadtest import http_client
from loadtest.bench_picker import start_baseline_envoy
from loadtest.procs import Proc
from loadtest.rawclient import StreamStats, cpu_seconds, one_stream
from loadtest.realvllm import launcher
from loadtest.rollout.load import Arrival, poisson_arrivals
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import percentile

# The setups' extra picker flags (None: Envoy alone).
SETUPS: dict[str, tuple[str, ...] | None] = {
    "rr": None,
    "picker": (),
    "noscrape": ("--no-scrape",),
    "noflow": ("--waiting-threshold", "1000000000"),
    # scraping 5x less often: does a scrape of the vLLM API server (whose event loop also sends every
    # token) cost TTFT? Within the noise on this box (docs, "Benchmarks", real vLLM)
    "scrape500": ("--scrape-interval", "0.5"),
}
ITL_BOUND_S = 0.05  # a stream's read deadline: max_tokens at 20 tokens/s, plus rawclient's 30 s


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f}/{five:.1f}"


def group_pids(pgid: int) -> list[int]:
    """The live processes of a process group (a vLLM server, its engine core and their helpers)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                pids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
    return pids


def group_cpu_seconds(pgid: int) -> float:
    """User + system CPU of every live process in a process group (a vLLM server and its engine)."""
    total = 0.0
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += cpu_seconds(pid)
    return total


def pin(pids: Sequence[int], cores: set[int]) -> None:
    """Confine every thread of these processes to `cores` (affinity is per thread on Linux)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError):
                    os.sched_setaffinity(int(task.name), cores)


@dataclass
class Result:
    name: str
    streams: list[StreamStats] = field(default_factory=list)
    wall_s: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    held: int = 0  # requests the picker queued more than 1 ms
    held_s: float = 0.0  # their summed wait
    scrape_failures: dict[str, int] = field(default_factory=dict)  # kind -> count
    engine_tokens: list[float] = field(default_factory=list)
    engine_queue_ms: float = 0.0  # mean time a request waited in the engines' own queues
    load: str = ""

    @property
    def completed(self) -> list[StreamStats]:
        return [s for s in self.streams if s.done and s.status == 200]

    def tokens(self) -> int:
        return sum(len(s.arrivals) for s in self.completed)

    def ttft_ms(self, q: float) -> float:
        ttfts = sorted(s.arrivals[0] - s.started for s in self.completed if s.arrivals)
        return percentile(ttfts, q) * 1e3


async def replay(port: int, arrivals: Sequence[Arrival]) -> tuple[list[StreamStats], float]:
    """Every arrival sent at its time (open loop); returns once each stream ended or hit its deadline."""
    started = time.monotonic()

    async def one(arrival: Arrival) -> StreamStats:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - started)))
        return await one_stream(port, arrival.max_tokens, ITL_BOUND_S)

    streams = await asyncio.gather(*(one(a) for a in arrivals))
    return list(streams), time.monotonic() - started


ENGINE_COUNTERS = (
    "vllm:generation_tokens_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
)


def engine_counters(servers: Sequence[launcher.RealVllm]) -> list[dict[str, float]]:
    """Each engine's generated tokens and queue time so far: the split of the work between them, and
    whether the engine itself had to queue requests (its scheduler's wait for a free slot)."""
    out = []
    for server in servers:
        samples = parse_metrics(http_client.get(f"{server.url}/metrics", timeout=5).text)
        out.append({c: sum(v for (name, _), v in samples.items() if name == c) for c in ENGINE_COUNTERS})
    return out


def flow_waits(stack: Stack) -> tuple[int, float, dict[str, int]]:
    """(requests the picker held > 1 ms, their summed wait, scrape failures by kind) from its metrics."""
    metrics = stack.picker_metrics()
    labels = (("outcome", "dispatched"),)
    count = metrics.get(("picker_flow_wait_seconds_count", labels), 0.0)
    quick = metrics.get(
        ("picker_flow_wait_seconds_bucket", (("le", "0.001"), ("outcome", "dispatched"))), 0.0
    )
    failures: dict[str, int] = {}
    for (name, sample_labels), value in metrics.items():
        if name == "picker_scrape_failures_total" and value:
            kind = dict(sample_labels).get("kind", "?")
            failures[kind] = failures.get(kind, 0) + int(value)
    return int(count - quick), metrics.get(("picker_flow_wait_seconds_sum", labels), 0.0), failures


async def measure(
    name: str, port: int, pids: dict[str, int], servers: Sequence[launcher.RealVllm], arrivals: list[Arrival]
) -> Result:
    result = Result(name)
    before_engines = engine_counters(servers)
    before = {n: (group_cpu_seconds(p) if n.startswith("vllm") else cpu_seconds(p)) for n, p in pids.items()}
    client_before = time.process_time()
    result.streams, result.wall_s = await replay(port, arrivals)
    result.cpu = {
        n: (group_cpu_seconds(p) if n.startswith("vllm") else cpu_seconds(p)) - before[n]
        for n, p in pids.items()
    }
    result.cpu["client"] = time.process_time() - client_before
    after_engines = engine_counters(servers)
    delta = [
        {c: a[c] - b[c] for c in ENGINE_COUNTERS} for a, b in zip(after_engines, before_engines, strict=True)
    ]
    result.engine_tokens = [d["vllm:generation_tokens_total"] for d in delta]
    queued = sum(d["vllm:request_queue_time_seconds_sum"] for d in delta)
    result.engine_queue_ms = (
        queued / max(1.0, sum(d["vllm:request_queue_time_seconds_count"] for d in delta)) * 1e3
    )
    result.load = load()
    return result


@contextmanager
def vllm_pair(
    workdir: Path, cores: Sequence[str], extra_args: Sequence[str]
) -> Iterator[list[launcher.RealVllm]]:
    """Two vLLM servers, each engine pinned to its own core; started one after the other (the bind is
    read from the environment at start), stopped by PID on exit."""
    with ExitStack() as stack:
        servers = []
        saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        try:
            for index, core in enumerate(cores):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core
                started = time.monotonic()
                server = stack.enter_context(
                    launcher.real_vllm(launcher.free_port(), workdir / f"vllm-{index}", extra_args=extra_args)
                )
                print(
                    f"  vLLM {index} on core {core}: healthy in {time.monotonic() - started:.0f} s",
                    flush=True,
                )
                servers.append(server)
        finally:
            if saved is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        yield servers


async def warm_up(port: int, count: int) -> None:
    """A few streams through the path first: the engines' first requests and Envoy's connections."""
    await asyncio.gather(*(one_stream(port, 16) for _ in range(count)))


async def run_setup(
    name: str,
    flags: tuple[str, ...] | None,
    workdir: Path,
    servers: Sequence[launcher.RealVllm],
    arrivals: list[Arrival],
    router_cores: set[int] | None = None,
) -> Result:
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    options = StackOptions(
        replicas=0, extra_envoy_endpoints=addresses, picker_endpoints=addresses, picker_args=flags or ()
    )
    stack = Stack(workdir / name, options)
    (workdir / name).mkdir(parents=True, exist_ok=True)
    baseline: Proc | None = None
    vllm_pids = {f"vllm{i}": s.pid for i, s in enumerate(servers)}
    try:
        if flags is None:
            baseline, port = await asyncio.to_thread(start_baseline_envoy, stack, workdir / name)
            pids = {"envoy": baseline.pid, **vllm_pids}
        else:
            await asyncio.to_thread(stack.start)
            assert stack.picker and stack.envoy
            port, pids = (
                stack.listen_port,
                {"picker": stack.picker.pid, "envoy": stack.envoy.pid, **vllm_pids},
            )
        if router_cores is not None:  # the routing side away from the engines (--router-core)
            pin([pid for name, pid in pids.items() if not name.startswith("vllm")], router_cores)
        await warm_up(port, 4)
        result = await measure(name, port, pids, servers, arrivals)
        if flags is not None:
            result.held, result.held_s, result.scrape_failures = await asyncio.to_thread(flow_waits, stack)
        return result
    finally:
        if baseline is not None:
            baseline.stop()
        await asyncio.to_thread(stack.stop)


def report(results: list[Result], arrivals: list[Arrival], duration_s: float) -> None:
    cores = os.cpu_count() or 1
    offered = sum(a.max_tokens for a in arrivals) / duration_s
    print(
        f"\n{len(arrivals)} streams offered over {duration_s:.0f} s ({len(arrivals) / duration_s:.1f}/s, "
        f"{offered:.0f} tokens/s offered); tokens/s = tokens received / (first send .. last end)"
    )
    print(
        f"{'setup':<9} | {'tok/s':>5} | {'done':>4} | {'fail':>4} | {'TTFT p50':>8} | {'p99':>6} | "
        f"{'held':>4} | {'held s':>6} | {'picker cpu s':>12} | {'share':>5} | {'envoy s':>7} | "
        f"{'vllm0/1 s':>11} | {'engine split':>12} | {'engine q ms':>11} | {'client s':>8} | {'load':>7}"
    )
    for r in results:
        picker = r.cpu.get("picker")
        picker_s = f"{picker:>12.1f}" if picker is not None else f"{'-':>12}"
        share = f"{picker / (r.wall_s * cores) * 100:>4.0f}%" if picker is not None else f"{'-':>5}"
        split = "/".join(f"{t / max(1.0, sum(r.engine_tokens)) * 100:.0f}" for t in r.engine_tokens)
        held = f"{r.held:>4} | {r.held_s:>6.1f}" if picker is not None else f"{'-':>4} | {'-':>6}"
        print(
            f"{r.name:<9} | {r.tokens() / r.wall_s:>5.0f} | {len(r.completed):>4} | "
            f"{len(r.streams) - len(r.completed):>4} | {r.ttft_ms(50):>6.0f}ms | {r.ttft_ms(99):>4.0f}ms | "
            f"{held} | {picker_s} | {share} | {r.cpu['envoy']:>7.1f} | "
            f"{r.cpu['vllm0']:>5.1f}/{r.cpu['vllm1']:<5.1f} | {split:>12} | {r.engine_queue_ms:>11.1f} | "
            f"{r.cpu['client']:>8.1f} | "
            f"{r.load:>7}"
        )
        if r.scrape_failures:
            print(f"  {r.name}: failed scrapes by kind {r.scrape_failures}")
        failed = Counter(
            f"{s.status} {s.error}".strip() for s in r.streams if not (s.done and s.status == 200)
        )
        if failed:
            print(f"  {r.name}: failed streams by status/error {dict(failed)}")
    print(
        "  share: picker CPU / (wall x cores); held: requests the picker's flow control queued > 1 ms;\n"
        "  engine split: % of generated tokens per engine; engine q: mean wait in vLLM's own queue;\n"
        "  load: 1/5-minute load average after the setup"
    )


async def run(args: argparse.Namespace) -> None:
    if reason := launcher.skip_reason():
        raise SystemExit(f"bench_realvllm: {reason}")
    names = args.setups.split(",")
    unknown = [n for n in names if n not in SETUPS]
    if unknown:
        raise SystemExit(f"unknown setups {unknown}; known: {list(SETUPS)}")
    arrivals = poisson_arrivals(args.rate, args.duration, (args.min_tokens, args.max_tokens), args.seed)
    print(f"bench_realvllm on {os.cpu_count()} cores, load {load()} at start", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-realvllm-") as tmp:
        workdir = Path(tmp)
        extra = ("--max-num-seqs", str(args.max_num_seqs)) if args.max_num_seqs else ()
        with vllm_pair(workdir, args.cores.split(","), extra) as servers:
            router_cores = None
            if args.router_core is not None:
                router_cores = {args.router_core}
                engine_cores = set(range(os.cpu_count() or 1)) - router_cores
                for server in servers:  # API servers and engines alike, away from the router's core
                    pin(group_pids(server.pid), engine_cores)
                pin([os.getpid()], router_cores)  # the client too (this thread; later ones inherit)
                print(
                    f"  router side (Envoy, picker, client) on core {args.router_core}, "
                    f"vLLM servers on {sorted(engine_cores)}",
                    flush=True,
                )
            results = []
            for _ in range(args.rounds):
                for name in names:
                    result = await run_setup(name, SETUPS[name], workdir, servers, arrivals, router_cores)
                    print(
                        f"  {name}: {result.tokens() / result.wall_s:.0f} tokens/s, "
                        f"TTFT p50 {result.ttft_ms(50):.0f} ms (load {result.load})",
                        flush=True,
                    )
                    results.append(result)
            report(results, arrivals, args.duration)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--setups", default="rr,picker,noscrape,noflow", help=f"comma-separated, of {list(SETUPS)}"
    )
    parser.add_argument("--rounds", type=int, default=2, help="repeat the setups, interleaved")
    # 2.5/s (about 340 tokens/s) leaves the engines room; at 5-8/s (750-1150 tokens/s) the box itself is
    # oversubscribed and every setup's TTFT is 0.3-1.5 s
    parser.add_argument("--rate", type=float, default=2.5, help="streams per second (Poisson)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per setup")
    parser.add_argument("--min-tokens", type=int, default=50)
    parser.add_argument("--max-tokens", type=int, default=250)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--cores", default="0,1", help="VLLM_CPU_OMP_THREADS_BIND of each vLLM")
    parser.add_argument(
        "--router-core",
        type=int,
        default=None,
        help="pin Envoy, the picker and the client to this core and both vLLM servers (every process) "
        "to the others: the picker with a core of its own (pass --cores without it, e.g. 1,1)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=0, help="vLLM --max-num-seqs (0: its default)")
    args = parser.parse_args()
    import uvloop

    uvloop.run(run(args))


if __name__ == "__main__":
    main()
