"""Benchmark: what the picker path adds, against Envoy round robin straight to the same replicas.

Prints, in one run and side by side: TTFT p50/p99 at 1, 16 and 64 concurrent streams through
(a) Envoy + picker (routing + observer filters) and (b) the same Envoy config without ext_proc
(round robin), and the picker's short-request throughput per CPU-second. Bounded: each phase stops
at its request count or its deadline. Run: `python -m loadtest.bench_picker` (about a minute).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import httpx
import yaml

from loadtest.procs import Proc, free_port, port_open
from loadtest.rawclient import cpu_seconds, one_stream
from loadtest.stack import Stack, StackOptions, health_ok
from loadtest.traffic import percentile
from picker.envoyconf import envoy_binary, render


def start_baseline_envoy(stack: Stack, workdir: Path) -> tuple[Proc, int]:
    """The stack's Envoy config minus both ext_proc filters: override_host falls back to round robin."""
    params = stack.envoy_params()
    listen, admin = free_port(), free_port()
    config = yaml.safe_load(
        render(params.__class__(**{**params.__dict__, "listen_port": listen, "admin_port": admin}))
    )
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if not f["name"].startswith("envoy.filters.http.ext_proc")
    ]
    path = workdir / "envoy-baseline.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = Proc(
        "envoy-baseline",
        [
            envoy_binary(),
            "-c",
            str(path),
            "--use-dynamic-base-id",
            "--log-level",
            "warn",
            "--concurrency",
            "1",
        ],
        workdir / "envoy-baseline.log",
    )
    proc.wait_ready(lambda: health_ok(admin, "/ready") and port_open(listen), timeout=30)
    return proc, listen


async def closed_loop_ttfts(port: int, level: int, count: int, max_tokens: int) -> tuple[list[float], int]:
    """`level` workers, one stream after another, `count` in all (raw client: cheap for the box)."""
    ttfts: list[float] = []
    failed = 0
    issued = 0

    async def worker() -> None:
        nonlocal issued, failed
        while issued < count:
            issued += 1
            stats = await one_stream(port, max_tokens, itl_s=0.01)
            if stats.arrivals and stats.done:
                ttfts.append(stats.arrivals[0] - stats.started)
            else:
                failed += 1

    await asyncio.gather(*(worker() for _ in range(level)))
    return sorted(ttfts), failed


async def ttft_table(picker_port: int, baseline_port: int, levels: list[int], max_tokens: int) -> None:
    print(f"\nTTFT through Envoy, {max_tokens}-token streams (ms; the replicas' own TTFT is 5 ms)")
    print(f"{'concurrency':>11} | {'path':<9} | {'requests':>8} | {'p50':>7} | {'p99':>7} | {'failed':>6}")
    for level in levels:
        count = max(100, level * 8)
        for name, port in (("baseline", baseline_port), ("picker", picker_port)):
            ttfts, failed = await closed_loop_ttfts(port, level, count, max_tokens)
            print(
                f"{level:>11} | {name:<9} | {count:>8} | {percentile(ttfts, 50) * 1e3:>7.2f} | "
                f"{percentile(ttfts, 99) * 1e3:>7.2f} | {failed:>6}"
            )


async def short_request_throughput(stack: Stack, url: str, seconds: float) -> None:
    assert stack.picker is not None
    body = {"model": "tiny-llama", "prompt": "x", "max_tokens": 1, "ignore_eos": True}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    done = 0
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds
    cpu_before = cpu_seconds(stack.picker.pid)
    async with httpx.AsyncClient(limits=limits, timeout=10) as client:

        async def worker() -> None:
            nonlocal done
            while loop.time() < stop_at and done < 200_000:
                response = await client.post(url + "/v1/completions", json=body)
                done += response.status_code == 200

        started = loop.time()
        await asyncio.gather(*(worker() for _ in range(32)))
        wall = loop.time() - started
    cpu = cpu_seconds(stack.picker.pid) - cpu_before
    print(f"\nshort non-streaming requests through Envoy + picker, 32 concurrent, {wall:.1f} s")
    print(
        f"  completed: {done} ({done / wall:.0f} req/s end to end; the client and replicas share the 2 cores)"
    )
    per_cpu_s = done / cpu if cpu else float("nan")
    print(f"  picker CPU: {cpu:.2f} s -> {per_cpu_s:.0f} requests per picker CPU-second")
    print(f"  picker CPU per request: {cpu / done * 1e6 if done else float('nan'):.0f} us")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--throughput-seconds", type=float, default=8.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        workdir = Path(tmp)
        options = StackOptions(replicas=3, sim_args=("--ttft-ms", "5", "--itl-ms", "10"))
        stack = Stack(workdir, options)
        await asyncio.to_thread(stack.start)
        baseline: Proc | None = None
        try:
            baseline, baseline_port = await asyncio.to_thread(start_baseline_envoy, stack, workdir)
            levels = [int(v) for v in args.levels.split(",")]
            await ttft_table(stack.listen_port, baseline_port, levels, args.max_tokens)
            await short_request_throughput(stack, stack.url, args.throughput_seconds)
        finally:
            if baseline is not None:
                baseline.stop()
            stack.stop()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
