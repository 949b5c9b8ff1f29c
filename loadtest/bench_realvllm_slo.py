"""Routing by predicted latency on two real vLLM replicas, one of them half as fast (issue 43).

Two vLLM CPU servers (the tiny model), each engine pinned to a core of its own; a busy loop pinned to
the second core takes about half of it (a noisy neighbour: the second replica runs at about half the
speed, as a replica with half the CPU threads would). The same seeded Poisson arrivals (shared system
prompts of a few hundred words, a short question each, 24 tokens out) go through two `picker proxy`
processes over the same two replicas:
  off       load + prefix affinity alone (affinity.latency off)
  auto      the picker's defaults (affinity.latency auto: routed by the predictions once the pool
            measurably is not uniform)
  on        affinity.latency on (each replica's TTFT and time per token learned online, always)
Prints TTFT p50/p90/p99, time per output token p50/p90 and each replica's share, per row. Bounded:
a finite arrival list per row, every request with a deadline. About 4 minutes with both vLLM starts.
Run: `python -m loadtest.bench_realvllm_slo` (needs `make real-vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp

from loadtest.procs import Proc, port_open
from loadtest.realvllm import launcher
from loadtest.traffic import percentile

# half of one core: 10 ms busy, 10 ms asleep, pinned to the core of the replica to slow down
_BURN = (
    "import os, time\nos.sched_setaffinity(0, {%d})\nwhile True:\n    t = time.perf_counter()\n"
    "    while time.perf_counter() - t < 0.01: pass\n    time.sleep(0.01)\n"
)


@contextmanager
def vllm_pair(workdir: Path, cores: Sequence[str]) -> Iterator[list[launcher.RealVllm]]:
    """Two vLLM servers, each engine pinned to its own core; stopped by PID on exit."""
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between rows
    with ExitStack() as stack:
        servers = []
        try:
            for index, core in enumerate(cores):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core  # read by vLLM at start
                port = launcher.free_port()
                servers.append(stack.enter_context(launcher.real_vllm(port, workdir / f"vllm-{index}")))
                print(f"  vLLM {index} on core {core}: healthy", flush=True)
        finally:
            if saved is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        yield servers


def prompts(groups: int, words: int) -> list[str]:
    rng = random.Random(1)
    return [
        f"System {g}. " + " ".join(f"w{rng.randrange(10**5)}" for _ in range(words)) for g in range(groups)
    ]


async def one(
    session: aiohttp.ClientSession, url: str, prompt: str, out: list[tuple[str, float, float]]
) -> None:
    body = {"model": launcher.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 24, "ignore_eos": True,
            "temperature": 0, "stream": True}  # fmt: skip
    sent = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return
            served = response.headers.get("x-gateway-destination-endpoint-served", "")
            first = last = None
            chunks = 0
            async for chunk in response.content.iter_any():
                now = time.monotonic()
                first = now if first is None else first
                last = now
                chunks += chunk.count(b'"text"')
    except (aiohttp.ClientError, TimeoutError):
        return
    if first is not None and last is not None:
        out.append((served, first - sent, (last - first) / max(1, chunks - 1)))


async def replay(
    url: str, texts: list[str], rate: float, count: int, seed: int
) -> list[tuple[str, float, float]]:
    rng = random.Random(seed)
    out: list[tuple[str, float, float]] = []
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks, at, started = [], 0.0, time.monotonic()
        for _ in range(count):
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))  # the arrival schedule
            prompt = (
                rng.choice(texts) + " Question: " + " ".join(f"q{rng.randrange(10**6)}" for _ in range(12))
            )
            tasks.append(asyncio.create_task(one(session, url, prompt, out)))
        await asyncio.gather(*tasks)
    return out


def start_proxy(workdir: Path, name: str, addresses: list[str], latency: str) -> tuple[Proc, str]:
    port, metrics = launcher.free_port(), launcher.free_port()
    argv = [
        sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics), "--endpoints", ",".join(addresses), "--log-level", "WARNING",
    ]  # fmt: skip
    env = {"PICKER_AFFINITY__LATENCY": latency}
    proc = Proc(f"proxy-{name}", argv, workdir / f"proxy-{name}.log", env=env)
    proc.wait_ready(lambda: "picker proxy ready" in proc.log_text() and port_open(port))
    return proc, f"http://127.0.0.1:{port}"


def ms(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) * 1e3 if values else float("nan")


async def run(args: argparse.Namespace) -> None:
    if reason := launcher.skip_reason():
        print(f"bench_realvllm_slo: {reason}")
        return
    with tempfile.TemporaryDirectory(prefix="bench-realvllm-slo-") as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        servers = stack.enter_context(vllm_pair(workdir, ("0", "1")))
        addresses = [f"127.0.0.1:{s.port}" for s in servers]
        names = {addresses[0]: "full", addresses[1]: "half"}
        burner = Proc("burner", [sys.executable, "-c", _BURN % 1], workdir / "burner.log")
        stack.callback(burner.stop)
        print("  a busy loop takes about half of core 1: replica 'half' runs at about half speed", flush=True)
        texts = prompts(args.groups, args.words)
        print(f"\n{args.requests} requests per row at {args.rate:g}/s (Poisson), 24 tokens out, greedy")
        print("  row       ok  TTFT p50  TTFT p90  TTFT p99  TPOT p50  TPOT p90  share (full/half)")
        rows = {}
        for name in args.rows.split(","):
            proc, url = start_proxy(workdir, name, addresses, name)
            try:
                async with aiohttp.ClientSession() as session:
                    for s in servers:
                        async with session.post(f"{s.url}/reset_prefix_cache") as response:
                            await response.read()
                await replay(url, texts, args.rate, args.warmup, seed=2)  # warm-up: the model learns
                out = rows[name] = await replay(url, texts, args.rate, args.requests, seed=3)
            finally:
                proc.stop()
            ttft, tpot = [t for _, t, _ in out], [p for *_, p in out]
            share = {
                n: sum(1 for r, *_ in out if names.get(r) == n) * 100 // max(1, len(out))
                for n in ("full", "half")
            }
            print(
                f"  {name:<8} {len(out):>4} {ms(ttft, 50):>8.0f}ms {ms(ttft, 90):>7.0f}ms"
                f" {ms(ttft, 99):>7.0f}ms {ms(tpot, 50):>7.1f}ms {ms(tpot, 90):>7.1f}ms"
                f"  {share['full']}% / {share['half']}%",
                flush=True,
            )
        if "off" in rows:
            base = [t for _, t, _ in rows["off"]]
            for name in rows.keys() - {"off"}:
                new = [t for _, t, _ in rows[name]]
                print(f"  {name} vs off: TTFT p90 {100 * (1 - ms(new, 90) / ms(base, 90)):+.0f}% lower")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--words", type=int, default=300, help="words of each group's system prompt")
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--rows", default="off,auto,on", help="affinity.latency settings, one row each")
    import uvloop

    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
