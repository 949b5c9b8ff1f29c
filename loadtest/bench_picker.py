"""Benchmark: what the picker path adds, against Envoy round robin straight to the same replicas.

Prints, in one run and side by side: TTFT p50/p99 at 1, 16 and 64 concurrent streams through
(a) Envoy + picker (routing + observer filters) and (b) the same Envoy config without ext_proc
(round robin), the picker's short-request throughput per CPU-second, and the cost of TLS on the
Envoy -> picker hop (the default) against a second Envoy + picker in plaintext on the same replicas:
TTFT and picker CPU per request, in interleaved rounds. Bounded: each phase stops at its request
count or its deadline. Run: `python -m loadtest.bench_picker` (about a minute and a half).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import yaml

from loadtest import http_client
from loadtest.procs import Proc, free_port, port_open
from loadtest.rawclient import cpu_seconds, one_stream
from loadtest.stack import Stack, StackOptions, health_ok
from loadtest.traffic import percentile
from picker.cli.envoyconf import envoy_binary, render


def _start_envoy(name: str, config: str, workdir: Path, admin: int, listen: int) -> Proc:
    """One Envoy (one worker thread) on `config`, ready; stopped by its PID if it is not."""
    path = workdir / f"{name}.yaml"
    path.write_text(config)
    argv = [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"]
    proc = Proc(name, [*argv, "--concurrency", "1"], workdir / f"{name}.log")
    try:
        proc.wait_ready(lambda: health_ok(admin, "/ready") and port_open(listen), timeout=30)
    except BaseException:
        proc.stop()
        raise
    return proc


def start_baseline_envoy(stack: Stack, workdir: Path) -> tuple[Proc, int]:
    """The stack's Envoy config minus both ext_proc filters: override_host falls back to round robin."""
    listen, admin = free_port(), free_port()
    config = yaml.safe_load(render(replace(stack.envoy_params(), listen_port=listen, admin_port=admin)))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if not f["name"].startswith("envoy.filters.http.ext_proc")
    ]
    return _start_envoy("envoy-baseline", yaml.safe_dump(config), workdir, admin, listen), listen


def start_floor(stack: Stack, workdir: Path) -> tuple[Proc, Proc, int]:
    """The stack's Envoy config in front of a server that decides nothing (loadtest/ext_proc_bare.py
    --shipped: TLS, the routing stream ended at its answer, observer and access log read): what
    Python gRPC alone costs in the shipped shape. The pool is a static cluster (the bare server
    serves no EDS), its replicas taken in turn. Returns (server, Envoy, listen port)."""
    port, listen, admin = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "loadtest.ext_proc_bare", "--stack", "grpc-aio-uvloop", "--shipped"]
    argv += ["--port", str(port), "--upstream", ",".join(stack.replicas)]
    server = Proc("floor", argv, workdir / "floor.log")
    try:
        server.wait_ready(lambda: "listening" in server.log_text())
        params = replace(
            stack.envoy_params(),
            listen_port=listen,
            admin_port=admin,
            picker_port=port,
            eds=False,
            picker_tls=True,
            access_log=str(workdir / "envoy-floor-access.log"),
        )
        envoy = _start_envoy("envoy-floor", render(params), workdir, admin, listen)
    except BaseException:
        server.stop()
        raise
    return server, envoy, listen


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
    async with http_client.AsyncClient(limits=limits, timeout=10) as client:

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


def idle_cpu_rate(pid: int, seconds: float) -> float:
    """A picker's own background CPU (scrapes, sweeps) per second, to subtract from a phase's."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)  # a benchmark's measurement window, not a synchronisation
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


async def tls_cost(tls_stack: Stack, plain_stack: Stack, levels: list[int], rounds: int) -> None:
    """The same short streams through TLS and plaintext stacks, alternating, so drift hits both."""
    stacks = {"tls": tls_stack, "plaintext": plain_stack}
    pids = {name: s.picker.pid for name, s in stacks.items()}  # type: ignore[union-attr]
    idle = {name: await asyncio.to_thread(idle_cpu_rate, pid, 2.0) for name, pid in pids.items()}
    print(
        "\nTLS on the Envoy -> picker hop vs plaintext (same replicas; 2-token streams; rounds interleaved)"
    )
    print(
        f"{'concurrency':>11} | {'picker hop':<10} | {'requests':>8} | {'TTFT p50':>8} | {'TTFT p99':>8} | "
        f"{'picker CPU/req':>14} | {'failed':>6}"
    )
    for level in levels:
        per_round = max(60, level * 25)
        ttfts: dict[str, list[float]] = {name: [] for name in stacks}
        cpu = dict.fromkeys(stacks, 0.0)
        failed = dict.fromkeys(stacks, 0)
        for _ in range(rounds):
            for name, stack in stacks.items():
                before, started = cpu_seconds(pids[name]), time.monotonic()
                got, bad = await closed_loop_ttfts(stack.listen_port, level, per_round, 2)
                elapsed = time.monotonic() - started
                cpu[name] += cpu_seconds(pids[name]) - before - idle[name] * elapsed
                ttfts[name] += got
                failed[name] += bad
        us: dict[str, float] = {}
        for name in stacks:
            done = len(ttfts[name])
            us[name] = cpu[name] / done * 1e6 if done else float("nan")
            p50, p99 = (percentile(sorted(ttfts[name]), q) * 1e3 for q in (50, 99))
            print(
                f"{level:>11} | {name:<10} | {done + failed[name]:>8} | {p50:>8.2f} | {p99:>8.2f} | "
                f"{us[name]:>11.0f} us | {failed[name]:>6}"
            )
        added = percentile(sorted(ttfts["tls"]), 50) - percentile(sorted(ttfts["plaintext"]), 50)
        print(
            f"{'':>11}   TLS adds {added * 1e3:+.2f} ms TTFT p50 and {us['tls'] - us['plaintext']:+.0f} us "
            "picker CPU per request"
        )
    url = f"http://127.0.0.1:{tls_stack.admin_port}/stats?filter=cluster.picker.ssl.handshake"
    async with http_client.AsyncClient(timeout=5) as client:
        handshakes = (await client.get(url)).text.strip()
    print(f"  TLS handshakes Envoy made to the picker in the whole run: {handshakes or 'none'}")


def start_plaintext_stack(stack: Stack, workdir: Path) -> Stack:
    """A second Envoy + picker, plaintext between them, routing to the first stack's replicas."""
    options = StackOptions(
        replicas=0,
        picker_endpoints=stack.replicas,
        extra_envoy_endpoints=stack.replicas,
        envoy_picker_tls=False,
    )
    return Stack(workdir / "plaintext", options).start()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--throughput-seconds", type=float, default=8.0)
    parser.add_argument("--tls-levels", default="1,16", help="concurrency levels of the TLS comparison")
    parser.add_argument("--tls-rounds", type=int, default=3, help="interleaved TLS/plaintext rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-picker-") as tmp:
        workdir = Path(tmp)
        options = StackOptions(replicas=3, sim_args=("--ttft-ms", "5", "--itl-ms", "10"))
        stack = Stack(workdir, options)
        await asyncio.to_thread(stack.start)
        baseline: Proc | None = None
        plain: Stack | None = None
        try:
            baseline, baseline_port = await asyncio.to_thread(start_baseline_envoy, stack, workdir)
            levels = [int(v) for v in args.levels.split(",")]
            await ttft_table(stack.listen_port, baseline_port, levels, args.max_tokens)
            await short_request_throughput(stack, stack.url, args.throughput_seconds)
            plain = await asyncio.to_thread(start_plaintext_stack, stack, workdir)
            tls_levels = [int(v) for v in args.tls_levels.split(",")]
            await tls_cost(stack, plain, tls_levels, args.tls_rounds)
        finally:
            if plain is not None:
                plain.stop()
            if baseline is not None:
                baseline.stop()
            stack.stop()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
