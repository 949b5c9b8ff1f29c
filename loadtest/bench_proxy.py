"""Benchmark: `picker proxy` against the Envoy paths (and vllm-router) on the same simulated replicas.

One run, side by side, every path in front of the same three replicas:
  direct        a replica itself (the zero for "added")
  envoy         Envoy alone, round robin (no picker)
  envoy+picker  Envoy + `picker serve` (ext_proc routing + observer), the shipped shape
  proxy         `picker proxy` (no Envoy)
  proxy+resume  `picker proxy` with streams.resume=always: every stream's events rewritten (issue 42)
                (`--token-ids`: every client asks for token ids itself, so the simulator does the same
                work in every row and the rows differ by the picker's own cost alone)
  vllm-router   the Rust router from PyPI, round robin (when its executable is found)
Prints: TTFT p50/p99 and what each path adds at 1/16/64 concurrent streams; chunk lateness p50/p99
at 200 concurrent 20 tokens/s streams with the path's CPU per chunk; 1-token request rate and CPU per
request. A raw asyncio client (loadtest.rawclient) keeps the client's cost out of the figures; every
phase is bounded by a count. Run: `python -m loadtest.bench_proxy` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from loadtest.bench_picker import closed_loop_ttfts, start_baseline_envoy
from loadtest.bench_streams import pct
from loadtest.procs import Proc, free_port, port_open
from loadtest.proxy_stack import ProxyStack
from loadtest.rawclient import ITL_S, cpu_seconds, one_stream
from loadtest.stack import Stack, StackOptions

SIM_ARGS = ("--ttft-ms", "5", "--itl-ms", str(ITL_S * 1000))
ROUTER_CANDIDATES = (".venv-router/bin/vllm-router",)  # `make bench` installs it there


@dataclass
class Path_:
    name: str
    port: int
    pids: list[int] = field(default_factory=list)

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)


def router_binary() -> str | None:
    """vllm-router's executable: $VLLM_ROUTER, on PATH, or .venv-router (`make bench` makes it)."""
    for candidate in (os.environ.get("VLLM_ROUTER"), shutil.which("vllm-router"), *ROUTER_CANDIDATES):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def start_router(binary: str, replicas: Sequence[str], workdir: Path) -> tuple[Proc, int]:
    port = free_port()
    argv = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin", "--worker-urls"]
    proc = Proc("vllm-router", [*argv, *(f"http://{r}" for r in replicas)], workdir / "vllm-router.log")
    proc.wait_ready(lambda: port_open(port), timeout=60)
    return proc, port


async def ttft_phase(paths: list[Path_], levels: list[int], tokens: int) -> None:
    print(f"\nTTFT, {tokens}-token streams, closed loop (ms; the replicas' own TTFT is 5 ms)")
    print(
        f"{'streams':>7} | {'path':<12} | {'requests':>8} | {'p50':>7} | {'p99':>7} | "
        f"{'added p50':>9} | {'added p99':>9} | {'failed':>6}"
    )
    for level in levels:
        count = max(100, level * 8)
        zero: tuple[float, float] | None = None
        for path in paths:
            ttfts, failed = await closed_loop_ttfts(path.port, level, count, tokens)
            p50, p99 = pct(ttfts, 50) * 1e3, pct(ttfts, 99) * 1e3
            zero = zero or (p50, p99)
            print(
                f"{level:>7} | {path.name:<12} | {count:>8} | {p50:>7.2f} | {p99:>7.2f} | "
                f"{p50 - zero[0]:>9.2f} | {p99 - zero[1]:>9.2f} | {failed:>6}"
            )


async def lateness_phase(paths: list[Path_], streams: int, tokens: int, token_ids: bool = False) -> None:
    print(f"\n{streams} concurrent streams x {tokens} tokens at {1 / ITL_S:.0f} tokens/s")
    print(
        f"{'path':<12} | {'chunks':>6} | {'late p50':>8} | {'late p99':>8} | {'TTFT p50':>8} | "
        f"{'TTFT p99':>8} | {'CPU/chunk us':>12} | {'failed':>6}"
    )
    for path in paths:
        cpu_before = path.cpu()
        tasks = []
        for _ in range(streams):
            tasks.append(asyncio.create_task(one_stream(path.port, tokens, token_ids=token_ids)))
            await asyncio.sleep(1.0 / streams)  # spread the streams' phases over one second
        results = await asyncio.gather(*tasks)
        cpu = path.cpu() - cpu_before
        lateness: list[float] = []
        ttfts: list[float] = []
        chunks = 0
        for r in results:
            if r.arrivals:
                ttfts.append(r.arrivals[0] - r.started)
                first = r.arrivals[0]
                lateness.extend((t - first - i * ITL_S) * 1e3 for i, t in enumerate(r.arrivals))
                chunks += len(r.arrivals)
        failed = sum(1 for r in results if not r.done)
        per_chunk = cpu / chunks * 1e6 if chunks and path.pids else float("nan")
        print(
            f"{path.name:<12} | {chunks:>6} | {pct(lateness, 50):>8.2f} | {pct(lateness, 99):>8.2f} | "
            f"{pct(ttfts, 50) * 1e3:>8.1f} | {pct(ttfts, 99) * 1e3:>8.1f} | {per_chunk:>12.0f} | {failed:>6}"
        )


async def rate_phase(paths: list[Path_], workers: int, count: int, token_ids: bool = False) -> None:
    print(f"\n1-token streaming requests, {workers} concurrent, {count} per path (new connection each)")
    print(f"{'path':<12} | {'req/s':>7} | {'CPU/req us':>10} | {'failed':>6}")
    for path in paths:
        cpu_before = path.cpu()
        started = time.perf_counter()
        issued = failed = 0

        async def worker(path: Path_ = path) -> None:
            nonlocal issued, failed
            while issued < count:
                issued += 1
                stats = await one_stream(path.port, 1, token_ids=token_ids)
                failed += not stats.done

        await asyncio.gather(*(worker() for _ in range(workers)))
        wall = time.perf_counter() - started
        cpu = path.cpu() - cpu_before
        per_request = cpu / count * 1e6 if path.pids else float("nan")
        print(f"{path.name:<12} | {count / wall:>7.0f} | {per_request:>10.0f} | {failed:>6}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels of the TTFT phase")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream of the lateness phase")
    parser.add_argument("--requests", type=int, default=2000, help="requests per path of the rate phase")
    parser.add_argument("--no-router", action="store_true", help="leave vllm-router out")
    parser.add_argument("--token-ids", action="store_true", help="every request asks for token ids itself")
    args = parser.parse_args()
    levels = [int(v) for v in args.levels.split(",") if v]
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        workdir = Path(tmp)
        options = StackOptions(replicas=3, sim_args=SIM_ARGS, picker_args=("--no-scrape",))
        envoy_stack = Stack(workdir, options)
        proxy_stack = ProxyStack(workdir, options)
        proxy_stack.replica_ports = envoy_stack.replica_ports  # the same simulators for every path
        (workdir / "resume").mkdir()
        resume_options = replace(options, picker_env={"PICKER_STREAMS__RESUME": "always"})
        resume_stack = ProxyStack(workdir / "resume", resume_options)
        resume_stack.replica_ports = envoy_stack.replica_ports
        procs: list[Proc] = []
        try:
            await asyncio.to_thread(envoy_stack.start)
            await asyncio.to_thread(proxy_stack.start_picker)
            await asyncio.to_thread(resume_stack.start_picker)
            baseline, baseline_port = await asyncio.to_thread(start_baseline_envoy, envoy_stack, workdir)
            procs.append(baseline)
            assert envoy_stack.envoy and envoy_stack.picker and proxy_stack.picker and resume_stack.picker
            paths = [
                Path_("direct", envoy_stack.replica_ports[0]),
                Path_("envoy", baseline_port, [baseline.pid]),
                Path_(
                    "envoy+picker", envoy_stack.listen_port, [envoy_stack.envoy.pid, envoy_stack.picker.pid]
                ),
                Path_("proxy", proxy_stack.listen_port, [proxy_stack.picker.pid]),
                Path_("proxy+resume", resume_stack.listen_port, [resume_stack.picker.pid]),
            ]
            binary = None if args.no_router else router_binary()
            if binary is not None:
                router, router_port = await asyncio.to_thread(
                    start_router, binary, envoy_stack.replicas, workdir
                )
                procs.append(router)
                paths.append(Path_("vllm-router", router_port, [router.pid]))
            elif not args.no_router:
                print(
                    "vllm-router: not found (`make bench` installs it into .venv-router; or set VLLM_ROUTER)"
                )
            print("paths: " + ", ".join(p.name for p in paths) + "; 3 replicas, one simulator process")
            await ttft_phase(paths, levels, tokens=2)
            await lateness_phase(paths, args.streams, args.tokens, args.token_ids)
            await rate_phase(paths, workers=32, count=args.requests, token_ids=args.token_ids)
        finally:
            for proc in procs:
                proc.stop()
            proxy_stack.picker and proxy_stack.picker.stop()
            resume_stack.picker and resume_stack.picker.stop()
            envoy_stack.stop()


if __name__ == "__main__":
    asyncio.run(main())
