"""Cache-aware routing on two real vLLM replicas (CPU build, the tiny model), side by side (issue 22).

Both engines run with prefix caching (vLLM's default), a small KV cache (`--num-gpu-blocks-override`,
blocks of 128 tokens) so that the prompt groups compete for it, their KV events on, and every stream's
usage with its cached tokens (`--enable-prompt-tokens-details --enable-force-include-usage`). Each
engine is pinned to a core of its own (VLLM_CPU_OMP_THREADS_BIND, as bench_realvllm pins them).
The same seeded Poisson arrivals (groups of long shared system prompts, a short question each,
8 tokens out: prefill dominates) go through:
  rr        Envoy alone, round robin
  load      Envoy + picker --prefix-affinity off
  approx    Envoy + picker (the default: approximate prefix affinity)
  precise   Envoy + picker --prefix-affinity precise (the engines' KV events, their /tokenize)
Hit rates come from the engines' own counters (vllm:prefix_cache_hits / queries). Bounded: a finite
arrival list, every request with a deadline. About 6 minutes with both vLLM starts.
Run: `python -m loadtest.bench_realvllm_affinity` (needs `make real-vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp

from loadtest import http_client
from loadtest.bench_picker import start_baseline_envoy
from loadtest.bench_realvllm import load
from loadtest.procs import Proc
from loadtest.realvllm import launcher
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import percentile

KV_OFFSET = 1000  # each engine publishes its KV events on its port + this
SETUPS: dict[str, tuple[str, ...] | None] = {
    "rr": None,
    "oracle": None,  # each group to one engine, straight (no Envoy, no picker): perfect affinity
    "load": ("--prefix-affinity", "off"),
    "approx": (),
    "approx-off": (),  # affinity.latency off (ENVIRONMENTS)
    "precise": ("--prefix-affinity", "precise", "--kv-events-port-offset", str(KV_OFFSET)),
}
ENVIRONMENTS = {"approx-off": {"PICKER_AFFINITY__LATENCY": "off"}}


def prompts(groups: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Group {g} instructions. " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))
        for g in range(groups)
    ]


async def one(session: aiohttp.ClientSession, url: str, prompt: str) -> float | None:
    body = {"model": launcher.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 8, "stream": True}
    started = time.monotonic()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                await response.read()
                return None
            first = None
            async for _ in response.content.iter_any():
                if first is None:
                    first = time.monotonic() - started
            return first
    except (aiohttp.ClientError, TimeoutError):
        return None


def counters(servers: Sequence[launcher.RealVllm]) -> tuple[float, float]:
    queries = hits = 0.0
    for server in servers:
        page = parse_metrics(http_client.get(f"{server.url}/metrics", timeout=10).text)
        queries += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_queries_total")
        hits += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_hits_total")
    return queries, hits


def reset_caches(servers: Sequence[launcher.RealVllm]) -> None:
    """vLLM's POST /reset_prefix_cache (served with VLLM_SERVER_DEV_MODE=1)."""
    for server in servers:
        http_client.post(f"{server.url}/reset_prefix_cache", timeout=30).raise_for_status()


def requests_of(texts: list[str], count: int, seed: int) -> list[tuple[int, str]]:
    """`count` (group, prompt) pairs: a group's shared prompt and a short question of its own."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        group = rng.randrange(len(texts))
        question = " Question: " + " ".join(f"q{rng.randrange(10**6)}" for _ in range(12))
        out.append((group, texts[group] + question))
    return out


async def closed_loop(
    urls: Sequence[str], texts: list[str], concurrency: int, count: int, seed: int
) -> list[float | None]:
    """`count` requests, `concurrency` at a time, in a seeded order; with several `urls`, group g
    goes to urls[g % len(urls)] (the oracle's perfect affinity)."""
    todo = requests_of(texts, count, seed)
    results: list[float | None] = [None] * count
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        position = 0

        async def worker() -> None:
            nonlocal position
            while position < count:
                index, position = position, position + 1
                group, prompt = todo[index]
                results[index] = await one(session, urls[group % len(urls)], prompt)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def replay(url: str, texts: list[str], rate: float, count: int, seed: int) -> list[float | None]:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        at = 0.0
        started = time.monotonic()
        for _ in range(count):
            at += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
            prompt = (
                rng.choice(texts) + " Question: " + " ".join(f"q{rng.randrange(10**6)}" for _ in range(12))
            )
            tasks.append(asyncio.create_task(one(session, url, prompt)))
        return list(await asyncio.gather(*tasks))


async def run_setup(
    name: str,
    flags: tuple[str, ...] | None,
    workdir: Path,
    servers: Sequence[launcher.RealVllm],
    args: argparse.Namespace,
) -> str:
    addresses = [f"127.0.0.1:{s.port}" for s in servers]
    options = StackOptions(
        replicas=0,
        extra_envoy_endpoints=addresses,
        picker_endpoints=addresses,
        picker_args=flags or (),
        picker_env=ENVIRONMENTS.get(name),
    )
    stack = Stack(workdir / name, options)
    (workdir / name).mkdir(parents=True, exist_ok=True)
    baseline: Proc | None = None
    picker_page: dict = {}
    picker_log = ""
    try:
        if name == "oracle":
            port = 0
        elif flags is None:
            baseline, port = await asyncio.to_thread(start_baseline_envoy, stack, workdir / name)
        else:
            await asyncio.to_thread(stack.start)
            port = stack.listen_port
        await asyncio.to_thread(reset_caches, servers)  # every setup starts from empty caches
        urls = [s.url for s in servers] if name == "oracle" else [f"http://127.0.0.1:{port}"]
        texts = prompts(args.groups, args.words, seed=1)
        if args.concurrency:
            await closed_loop(urls, texts, args.concurrency, args.warmup, seed=2)
            before = counters(servers)
            ttfts = await closed_loop(urls, texts, args.concurrency, args.requests, seed=3)
        else:
            await replay(urls[0], texts, args.rate, args.warmup, seed=2)  # warm-up, not measured
            before = counters(servers)
            ttfts = await replay(urls[0], texts, args.rate, args.requests, seed=3)
        after = counters(servers)
        if flags is not None and name != "oracle":
            metrics_port = stack.picker_ports[0][2]
            picker_page = parse_metrics(http_client.get(f"http://127.0.0.1:{metrics_port}/metrics").text)
            picker_log = stack.picker.log_text() if stack.picker is not None else ""
    finally:
        if baseline is not None:
            baseline.stop()
        await asyncio.to_thread(stack.stop)
    done = sorted(t for t in ttfts if t is not None)
    queries, hits = after[0] - before[0], after[1] - before[1]
    p50 = percentile(done, 50) * 1e3 if done else float("nan")
    p99 = percentile(done, 99) * 1e3 if done else float("nan")
    picks = sorted(int(v) for (n, _), v in picker_page.items() if n == "picker_picks_total")
    reasons = {
        dict(labels).get("how", "?"): int(v)
        for (n, labels), v in picker_page.items()
        if n == "picker_affinity_picks_total"
    }
    engaged = sum(1 for line in picker_log.splitlines() if "affinity.latency auto: engaged" in line)
    extra = f" picks {picks} reasons {reasons} engaged {engaged}x" if picker_page else ""
    return (
        f"  {name:<10} {len(done):>5} {len(ttfts) - len(done):>4} {p50:>9.0f} {p99:>9.0f} "
        f"{hits / queries * 100 if queries else 0:>7.1f}  {extra} (load {load()})"
    )


async def run(args: argparse.Namespace) -> None:
    if reason := launcher.skip_reason():
        raise SystemExit(f"bench_realvllm_affinity: {reason}")
    print(f"bench_realvllm_affinity on {os.cpu_count()} cores, load {load()} at start", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-realvllm-affinity-") as tmp:
        workdir = Path(tmp)
        ports = [launcher.free_port(KV_OFFSET), launcher.free_port(KV_OFFSET)]
        extra_common = [
            "--num-gpu-blocks-override", str(args.blocks), "--max-model-len", "4096",
            "--enable-prompt-tokens-details", "--enable-force-include-usage",
        ]  # fmt: skip
        with vllm_pair_with_events(workdir, args.cores.split(","), extra_common, ports) as servers:
            print(
                f"  {args.groups} groups of ~{args.words}-word prompts, {args.rate}/s, "
                f"{args.requests} measured after {args.warmup}; {args.blocks} cache blocks of 128 tokens"
            )
            print(f"  {'row':<8} {'ok':>5} {'fail':>4} {'TTFT p50':>9} {'TTFT p99':>9} {'hit %':>7}")
            for name in args.setups.split(","):
                print(await run_setup(name, SETUPS[name], workdir, servers, args), flush=True)


@contextmanager
def vllm_pair_with_events(
    workdir: Path, cores: Sequence[str], extra: Sequence[str], ports: Sequence[int]
) -> Iterator[list[launcher.RealVllm]]:
    """Two vLLM servers, each engine pinned to its own core, each publishing its KV events on its
    serving port + KV_OFFSET; started one after the other, stopped by PID on exit."""
    saved = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache between setups
    with ExitStack() as stack:
        servers = []
        try:
            for index, (core, port) in enumerate(zip(cores, ports, strict=True)):
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core  # read by vLLM at start
                events = {
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"tcp://*:{port + KV_OFFSET}",
                    "topic": f"kv@127.0.0.1@{launcher.SERVED_MODEL_NAME}",
                }
                arguments = [*extra, "--kv-events-config", json.dumps(events)]
                server = stack.enter_context(
                    launcher.real_vllm(port, workdir / f"vllm-{index}", extra_args=arguments)
                )
                print(f"  vLLM {index} on core {core}: healthy", flush=True)
                servers.append(server)
        finally:
            if saved is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = saved
        yield servers


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--setups", default="rr,load,approx,precise")
    parser.add_argument("--groups", type=int, default=6)
    parser.add_argument("--words", type=int, default=300, help="words of each group's system prompt")
    parser.add_argument("--blocks", type=int, default=40, help="cache blocks (128 tokens) per engine")
    parser.add_argument("--rate", type=float, default=3.0)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--requests", type=int, default=90)
    parser.add_argument("--cores", default="0,1")
    parser.add_argument(
        "--concurrency", type=int, default=0, help="closed loop, this many at a time (0: Poisson at --rate)"
    )
    import uvloop

    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
