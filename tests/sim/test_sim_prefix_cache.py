"""The simulator's prefix cache, prefill compute, KV events, /tokenize and LoRA adapters (issue 22)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
import zmq
import zmq.asyncio
from simkit import fast_config
from vllm_sim import run_sim
from vllm_sim.config import CacheConfig, LatencyConfig
from vllm_sim.prefix import PrefixCache, block_hashes, text_tokens

from loadtest import http_client
from loadtest.procs import free_port
from loadtest.stack import parse_metrics

SYSTEM = "You are a careful assistant. " * 80  # ~2,240 characters: 560 tokens


def cached_of(body: dict[str, object]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index, no-any-return]


def test_the_cache_hits_leading_full_blocks_and_evicts_least_recently_used() -> None:
    cache = PrefixCache(block_size=4, num_blocks=3)
    tokens = list(range(12))
    assert cache.lookup(tokens) == 0
    stored = cache.store(tokens)
    assert [len(s.hashes) for s in stored.segments] == [3] and stored.removed == []
    assert cache.lookup(tokens) == 12
    assert cache.lookup([*tokens[:8], 99, 99, 99, 99]) == 8  # diverges in the third block
    other = cache.store([50, 51, 52, 53])  # a fourth block: the least recently used one goes
    assert len(other.removed) == 1
    assert cache.lookup(tokens[:4], salt="tenant-b") == 0  # a salt isolates
    assert block_hashes(tokens, 4) != block_hashes(tokens, 4, salt="s")


async def test_a_repeated_prompt_is_served_from_cache_and_counted() -> None:
    config = fast_config(cache=CacheConfig(block_size=16, prompt_tokens_details=True))
    async with run_sim(config) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = {"model": "tiny-llama", "prompt": SYSTEM + "Question one?", "max_tokens": 2}
        first = (await http.post("/v1/completions", json=body)).json()
        second = (await http.post("/v1/completions", json={**body, "prompt": SYSTEM + "Another?"})).json()
        assert cached_of(first) == 0
        prompt = first["usage"]["prompt_tokens"]
        assert cached_of(second) == (len(text_tokens(SYSTEM)) // 16) * 16  # full blocks only
        metrics = parse_metrics((await http.get("/metrics")).text)
        labels = (("engine", "0"), ("model_name", "tiny-llama"))
        assert metrics[("vllm:prefix_cache_hits_total", labels)] == cached_of(second)
        assert (
            metrics[("vllm:prefix_cache_queries_total", labels)] == prompt + second["usage"]["prompt_tokens"]
        )
        info = next(k for k in metrics if k[0] == "vllm:cache_config_info")
        assert ("block_size", "16") in info[1]
        tokens = (await http.post("/tokenize", json={"prompt": SYSTEM + "Question one?"})).json()
        assert tokens["count"] == prompt and len(tokens["tokens"]) == prompt


async def test_prefill_is_shared_compute_and_cache_hits_free_it() -> None:
    rate = 20_000.0  # tokens/s: 4,000 uncached tokens take 200 ms
    config = fast_config(
        latency=LatencyConfig(ttft_ms=1.0, itl_ms=1.0), cache=CacheConfig(prefill_tokens_per_s=rate)
    )
    prompt = "x" * 16_000  # 4,000 tokens
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=20) as http,
    ):
        body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
        started = time.monotonic()
        await http.post("/v1/completions", json=body)
        cold = time.monotonic() - started
        started = time.monotonic()
        await http.post("/v1/completions", json=body)
        warm = time.monotonic() - started
        assert cold >= 0.19 and warm < cold / 4
        fresh = [{**body, "prompt": f"{i}" + "y" * 16_000} for i in range(3)]  # three cold prompts at once
        started = time.monotonic()
        await asyncio.gather(*(http.post("/v1/completions", json=b) for b in fresh))
        assert time.monotonic() - started >= 3 * 0.19  # one prefill after another


async def test_kv_events_follow_the_cache_with_sequence_numbers() -> None:
    port = free_port()
    config = fast_config(cache=CacheConfig(block_size=16, num_gpu_blocks=40))
    context = zmq.asyncio.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@")
    subscriber.connect(f"tcp://127.0.0.1:{port}")
    try:
        async with (
            run_sim(config, kv_events_ports=[port]) as (replica,),
            http_client.AsyncClient(base_url=replica.url) as http,
        ):
            for i in range(50):  # the subscription takes a moment to reach the publisher (ZMQ)
                prompt = f"{i:04d}" + "z" * 636  # 160 tokens: 10 blocks, new each time
                await http.post(
                    "/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1}
                )
                if await subscriber.poll(50):
                    break
            topic, seq, payload = await asyncio.wait_for(subscriber.recv_multipart(), 5)
            assert topic == b"kv@127.0.0.1@tiny-llama" and len(seq) == 8
            _, events = msgpack.unpackb(payload)
            assert events[0]["type"] == "BlockStored" and len(events[0]["block_hashes"]) == 10
            assert len(events[0]["token_ids"]) == 160 and events[0]["block_size"] == 16
            big = {"model": "tiny-llama", "prompt": "w" * 2560, "max_tokens": 1}  # 40 blocks: evicts
            await http.post("/v1/completions", json=big)
            _, seq2, payload = await asyncio.wait_for(subscriber.recv_multipart(), 5)
            kinds = [e["type"] for e in msgpack.unpackb(payload)[1]]
            assert kinds == ["BlockStored", "BlockRemoved"]
            assert int.from_bytes(seq2, "big") == int.from_bytes(seq, "big") + 1
            await http.post("/sim/kv-events/skip", json={"count": 2})
            await http.post("/reset_prefix_cache")
            _, seq3, payload = await asyncio.wait_for(subscriber.recv_multipart(), 5)
            assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
            assert int.from_bytes(seq3, "big") == int.from_bytes(seq2, "big") + 3  # the gap
    finally:
        subscriber.close(0)
        context.term()


async def test_lora_adapters_are_served_listed_and_limited() -> None:
    config = fast_config(
        latency=LatencyConfig(ttft_ms=1.0, itl_ms=20.0),
        cache=CacheConfig(lora_modules=("sql", "chat"), max_loras=1),
    )
    async with (
        run_sim(config) as (replica,),
        http_client.AsyncClient(base_url=replica.url, timeout=20) as http,
    ):
        names = [card["id"] for card in (await http.get("/v1/models")).json()["data"]]
        assert names == ["tiny-llama", "sql", "chat"]
        long = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True}
        running = asyncio.create_task(http.post("/v1/completions", json={**long, "model": "sql"}))
        await asyncio.sleep(0.1)  # a measurement of the state while it runs, not a synchronisation
        waiting = asyncio.create_task(http.post("/v1/completions", json={**long, "model": "chat"}))
        base = await http.post("/v1/completions", json={**long, "model": "tiny-llama", "max_tokens": 1})
        assert base.status_code == 200  # the base model passes the adapter waiting for a slot
        metrics = parse_metrics((await http.get("/metrics")).text)
        (lora,) = [labels for name, labels in metrics if name == "vllm:lora_requests_info"]
        assert dict(lora) == {
            "max_lora": "1",
            "running_lora_adapters": "sql",
            "waiting_lora_adapters": "chat",
        }
        assert (await running).status_code == 200 and (await waiting).status_code == 200
        unknown = await http.post("/v1/completions", json={**long, "model": "nope"})
        assert unknown.status_code == 404


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "f"}}]])
async def test_chat_tokens_count_the_template_and_tools(tools: object) -> None:
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        messages = [{"role": "system", "content": "abcdefgh"}, {"role": "user", "content": "ijkl"}]
        body = {
            "model": "tiny-llama",
            "messages": messages,
            "max_tokens": 1,
            **({"tools": tools} if tools else {}),
        }
        answer = (await http.post("/v1/chat/completions", json=body)).json()
        tokens = (await http.post("/tokenize", json=body)).json()
        assert answer["usage"]["prompt_tokens"] == tokens["count"]
        assert (tokens["count"] == 2 + (4 + 2) + (4 + 1)) == (tools is None)


async def test_the_hit_counters_survive_an_emptied_cache() -> None:
    """vLLM's counters count since start: emptying the cache (`/reset_prefix_cache`) leaves them as they
    were (an empty cache once read as none, and the counters dropped to 0)."""
    config = fast_config(cache=CacheConfig(block_size=16))
    async with run_sim(config) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = {"model": "tiny-llama", "prompt": SYSTEM + "Question one?", "max_tokens": 2}
        await http.post("/v1/completions", json=body)
        await http.post("/v1/completions", json=body)
        labels = (("engine", "0"), ("model_name", "tiny-llama"))
        before = parse_metrics((await http.get("/metrics")).text)
        assert before[("vllm:prefix_cache_hits_total", labels)] > 0
        (await http.post("/reset_prefix_cache")).raise_for_status()
        after = parse_metrics((await http.get("/metrics")).text)
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            assert after[(name, labels)] == before[(name, labels)]
