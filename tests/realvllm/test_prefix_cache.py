"""Prefix caching and KV events on a real vLLM 0.32 (CPU build) against the picker's view (issue 22).

vLLM runs with `--kv-events-config` (ZMQ PUB, bound on a port of its own), a small cache
(`--num-gpu-blocks-override 40`: 40 blocks of 128 tokens) and `--enable-prompt-tokens-details`.
The picker's KV-event reader (picker/sources/kv_events.py) follows it; for each prompt the blocks
the picker believes the replica holds must be what vLLM reports as cached on the next request
(`usage.prompt_tokens_details.cached_tokens`), through storing and eviction. The raw events'
shape is checked against what the simulator sends (its KV events, sim/vllm_sim/kv_events.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from loadtest import http_client
from loadtest.procs import async_wait_until
from loadtest.realvllm import launcher
from picker.config.model import AffinityConfig
from picker.pool import Pool
from picker.scheduling.prefix import seed_of, token_blocks
from picker.sources.kv_events import KvEvents

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

BLOCK = 128  # vLLM's CPU KV block


@pytest.fixture(scope="module")
def vllm_with_events(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One vLLM for both checks (a start costs ~50 s here): each uses prompts of its own."""
    vllm_workdir = tmp_path_factory.mktemp("realvllm-events")
    port, kv_port = launcher.free_port(), launcher.free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{kv_port}",
        "topic": f"kv@127.0.0.1@{launcher.SERVED_MODEL_NAME}",
    }
    # 40 blocks: a cache small enough to evict from; a context that fits in it
    extra = ["--kv-events-config", json.dumps(config), "--num-gpu-blocks-override", "40",
             "--max-model-len", "4096", "--enable-prompt-tokens-details"]  # fmt: skip
    with launcher.real_vllm(port, vllm_workdir, extra_args=extra) as server:
        yield server, kv_port


async def tokens_of(http: httpx.AsyncClient, prompt: str) -> list[int]:
    response = await http.post("/tokenize", json={"model": launcher.SERVED_MODEL_NAME, "prompt": prompt})
    response.raise_for_status()
    return list(response.json()["tokens"])


async def cached_tokens(http: httpx.AsyncClient, prompt: str) -> int:
    body = {"model": launcher.SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1}
    response = await http.post("/v1/completions", json=body)
    response.raise_for_status()
    details = response.json()["usage"]["prompt_tokens_details"] or {}
    return int(details.get("cached_tokens") or 0)


def words(seed: int, count: int) -> str:
    return " ".join(f"item{seed}x{i}" for i in range(count))


@pytest.fixture
async def picker_view(vllm_with_events) -> AsyncIterator[tuple[object, KvEvents, Pool]]:  # type: ignore[no-untyped-def]
    server, kv_port = vllm_with_events
    pool = Pool()
    pool.apply(ready=[f"127.0.0.1:{server.port}"])
    events = KvEvents(pool, AffinityConfig(prefix="precise", kv_events_port=kv_port))
    task = asyncio.create_task(events.run())
    try:
        yield server, events, pool
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_pickers_view_matches_what_vllm_reports_cached(picker_view) -> None:  # type: ignore[no-untyped-def]
    server, events, pool = picker_view
    endpoint = pool.get(f"127.0.0.1:{server.port}")
    async with http_client.AsyncClient(base_url=server.url, timeout=120) as http:
        for i in range(60):  # until the subscription has reached vLLM's publisher (ZMQ)
            await cached_tokens(http, words(1000 + i, 200))
            if events.messages:
                break
        assert events.messages, "no KV event reached the picker"
        prompt = words(1, 150)  # a few full blocks of 128 tokens
        tokens = await tokens_of(http, prompt)
        keys = token_blocks(tokens, BLOCK, seed_of(launcher.SERVED_MODEL_NAME))
        assert len(keys) >= 3
        assert await cached_tokens(http, prompt) == 0  # cold
        await async_wait_until(lambda: all(k in endpoint.kv for k in keys), 10, what="BlockStored")
        predicted = sum(1 for k in keys if k in endpoint.kv) * BLOCK
        assert await cached_tokens(http, prompt) == predicted  # the picker's view is vLLM's cache
        for i in range(12):  # more than the 40 blocks hold, in all
            await cached_tokens(http, words(2000 + i, 150))
        await async_wait_until(lambda: not any(k in endpoint.kv for k in keys), 10, what="BlockRemoved")
        assert await cached_tokens(http, prompt) == 0  # evicted, as the picker saw
    assert events.bad == 0


async def test_vllms_raw_events_have_the_fields_the_simulator_sends(vllm_with_events) -> None:  # type: ignore[no-untyped-def]
    server, kv_port = vllm_with_events
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber.connect(f"tcp://127.0.0.1:{kv_port}")
    try:
        async with http_client.AsyncClient(base_url=server.url, timeout=120) as http:
            for i in range(60):
                await cached_tokens(http, words(3000 + i, 300))
                if await subscriber.poll(200):
                    break
            topic, sequence, payload = await asyncio.wait_for(subscriber.recv_multipart(), 30)
        assert topic == f"kv@127.0.0.1@{launcher.SERVED_MODEL_NAME}".encode() and len(sequence) == 8
        batch = msgpack.unpackb(payload, strict_map_key=False)
        events = batch[1]
        stored = next(e for e in events if (e.get("type") if isinstance(e, dict) else e[0]) == "BlockStored")
        assert isinstance(stored, dict), "vLLM 0.32 sends events as maps (the simulator does too)"
        simulated = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                     "medium", "lora_name", "extra_keys"}  # fmt: skip
        assert simulated <= stored.keys()  # everything the simulator sends, vLLM sends
        assert stored["block_size"] == BLOCK
        assert len(stored["token_ids"]) == BLOCK * len(stored["block_hashes"])
    finally:
        subscriber.close(0)
        context.term()
