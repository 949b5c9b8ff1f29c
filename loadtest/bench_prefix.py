"""What cache-aware routing costs the picker (issue 22), each figure beside its bound:
  hashing     an 8,000-token prompt (32 KB) into chained block keys       bound: 50 us
  index       bytes per block held in an endpoint's approximate index      bound: 100 bytes
  learning    adding one prompt's blocks to an index
  room        how many blocks a full index holds (asked of every candidate at every pick)  bound: 1 us
  kv events   the picker's CPU following 4 busy engines' KV events          bound: 5 % of a core
  tokenize    precise affinity's /tokenize round trip to a simulated engine, per request
KV events come from 4 publishers in another process (vllm_sim's publisher, real ZMQ over
loopback), each sending what a busy engine sends: every 100 ms a prefill of 4,000 new tokens
(250 blocks stored) and as many evicted. Run: `python -m loadtest.bench_prefix` (about 40 s).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import resource
import statistics
import sys
import time
import tracemalloc
from collections.abc import Sequence

from loadtest.procs import free_port


def hashing() -> None:
    from picker.scheduling.prefix import prompt_blocks, seed_of

    material = os.urandom(32_000)
    seed = seed_of("m")
    for block_tokens in (64, 128):
        runs = []
        for _ in range(5):
            started = time.process_time()
            for _ in range(2000):
                prompt_blocks(material, block_tokens * 4, seed, 2048)
            runs.append((time.process_time() - started) / 2000 * 1e6)
        best, median = min(runs), statistics.median(runs)
        print(f"  hashing, {block_tokens}-token blocks: {best:6.1f} us per prompt (median {median:.1f})")


def index() -> None:
    from picker.pool.cache import PrefixIndex

    rng = random.Random(1)
    prompts = [tuple(rng.getrandbits(64) for _ in range(125)) for _ in range(600)]
    tracemalloc.start()
    baseline = tracemalloc.get_traced_memory()[0]
    held = PrefixIndex(capacity=50_000)
    keys = [tuple(rng.getrandbits(64) for _ in range(125)) for _ in range(400)]  # 50,000 blocks
    for prompt in keys:
        held.add(prompt)
    size = tracemalloc.get_traced_memory()[0] - baseline
    tracemalloc.stop()
    print(f"  index: {size / len(held):6.1f} bytes per block held ({len(held)} blocks, keys included)")
    started = time.process_time()
    for prompt in prompts * 5:
        held.add(prompt)
    per = (time.process_time() - started) / (len(prompts) * 5) * 1e6
    print(f"  learning: {per:6.1f} us to add a 125-block prompt")
    started = time.process_time()
    for _ in range(1000):
        len(held)
    per = (time.process_time() - started) / 1000 * 1e6
    print(f"  room: {per:6.2f} us to count the {len(held)} blocks a full index holds (bound 1 us)")


def _publish(ports: Sequence[int], seconds: float, ready: multiprocessing.synchronize.Event) -> None:
    from vllm_sim.kv_events import KvEventPublisher
    from vllm_sim.prefix import PrefixCache

    publishers = [KvEventPublisher("127.0.0.1", port, "m", 16) for port in ports]
    caches = [PrefixCache(16, 2000) for _ in ports]
    ready.set()
    rng = random.Random(2)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for publisher, cache in zip(publishers, caches, strict=True):
            tokens = [rng.randrange(50_000) for _ in range(4000)]
            publisher.stored(cache.store(tokens))
        time.sleep(0.1)  # the publishers' pace: one prefill per engine every 100 ms
    for publisher in publishers:
        publisher.close()


async def kv_events() -> None:
    from picker.config.model import AffinityConfig
    from picker.pool import Pool
    from picker.sources.kv_events import KvEvents

    serving = [free_port() for _ in range(4)]
    kv = [free_port() for _ in range(4)]
    pool = Pool()
    pool.apply(ready=[f"127.0.0.1:{port}" for port in serving])
    config = AffinityConfig(prefix="precise", kv_events_port=kv[0])
    events = KvEvents(pool, config)
    events._url = lambda address: f"tcp://127.0.0.1:{kv[serving.index(int(address.rsplit(':', 1)[1]))]}"  # type: ignore[method-assign]
    ready = multiprocessing.Event()
    publisher = multiprocessing.Process(target=_publish, args=(kv, 14.0, ready))
    publisher.start()
    ready.wait(10)
    task = asyncio.create_task(events.run())
    await asyncio.sleep(3)  # warm-up: the subscriptions reach the publishers (a measurement window)
    before, messages, started = time.process_time(), events.messages, time.monotonic()
    await asyncio.sleep(8)  # the measured window
    cpu, wall = time.process_time() - before, time.monotonic() - started
    count = events.messages - messages
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    publisher.join(10)
    blocks = sum(len(e.kv) for e in pool.endpoints() if e.kv is not None)
    print(
        f"  kv events: {cpu / wall * 100:5.2f} % of a core for {count / wall:.0f} batches/s "
        f"({count / wall * 250:.0f} blocks stored/s and as many removed), {cpu / max(count, 1) * 1e6:.0f} us "
        f"per batch; {blocks} blocks held; {events.bad} bad"
    )


async def tokenize() -> None:
    import httpx
    from vllm_sim import run_sim
    from vllm_sim.config import SimConfig

    from picker.pool import Pool
    from picker.sources.tokenizer import EngineTokenizer

    async with run_sim(SimConfig()) as (replica,):
        pool = Pool()
        pool.apply(ready=[replica.address])
        tokenizer = EngineTokenizer(pool, 1.0)
        prompt = {"prompt": "x" * 32_000}
        for _ in range(20):
            await tokenizer.tokenize("tiny-llama", prompt)
        times = []
        cpu = time.process_time()
        for _ in range(200):
            started = time.perf_counter()
            await tokenizer.tokenize("tiny-llama", prompt)
            times.append(time.perf_counter() - started)
        cpu = time.process_time() - cpu
        await tokenizer.aclose()
        del httpx
    times.sort()
    print(
        f"  tokenize (8,000 tokens, a simulated engine in this process): {times[100] * 1e3:.2f} ms p50, "
        f"{times[197] * 1e3:.2f} ms p99 per request, both sides' CPU {cpu / 200 * 1e6:.0f} us"
    )


def main() -> None:
    print(f"bench_prefix on {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    hashing()
    index()
    import uvloop

    uvloop.run(kv_events())
    uvloop.run(tokenize())
    print(f"  (this process: max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB)")


if __name__ == "__main__":
    sys.exit(main())
