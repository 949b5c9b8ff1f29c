"""The engines' KV events as the picker reads them (issue 22): both wire forms, gaps, parents, and a
simulated replica's real stream matching what the replica holds."""

from __future__ import annotations

import asyncio

import msgpack
from vllm_sim import run_sim
from vllm_sim.config import CacheConfig
from vllm_sim.prefix import completion_tokens

from loadtest import http_client
from loadtest.procs import async_wait_until, free_port
from picker.config.model import AffinityConfig
from picker.pool import Pool
from picker.pool.cache import KvBlocks
from picker.scheduling.prefix import seed_of, token_blocks
from picker.sources.kv_events import KvEvents, apply_batch
from tests.sim.simkit import fast_config

TOKENS = list(range(1000, 1064))  # 4 blocks of 16


def batch(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events)])


def test_stored_blocks_are_keyed_by_their_tokens_in_either_wire_form() -> None:
    expected = token_blocks(TOKENS, 16, seed_of("m"))
    for stored in (
        {
            "type": "BlockStored",
            "block_hashes": [11, 12, 13, 14],
            "parent_block_hash": None,
            "token_ids": TOKENS,
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
        },
        ["BlockStored", [11, 12, 13, 14], None, TOKENS, 16, None, "GPU", None, None, 0],
    ):
        view = KvBlocks()
        assert apply_batch(view, "m", 0, batch(stored)) == 1
        assert all(key in view for key in expected) and view.block_size == 16


def test_children_chain_from_their_parent_and_removals_and_clears_apply() -> None:
    view = KvBlocks()
    apply_batch(
        view,
        "m",
        0,
        batch(
            {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": TOKENS[:32],
                "block_size": 16,
            }
        ),
    )
    apply_batch(
        view,
        "m",
        1,
        batch(
            {
                "type": "BlockStored",
                "block_hashes": [13, 14],
                "parent_block_hash": 12,
                "token_ids": TOKENS[32:],
                "block_size": 16,
            }
        ),
    )
    assert all(key in view for key in token_blocks(TOKENS, 16, seed_of("m")))
    apply_batch(view, "m", 2, batch(["BlockRemoved", [14], "GPU"]))
    assert len(view) == 3
    apply_batch(
        view,
        "m",
        3,
        batch(
            {
                "type": "BlockStored",
                "block_hashes": [99],
                "parent_block_hash": 777,
                "token_ids": TOKENS[:16],
                "block_size": 16,
            }
        ),
    )
    assert len(view) == 3  # an unknown parent: those blocks cannot be keyed
    apply_batch(view, "m", 4, batch({"type": "AllBlocksCleared"}))
    assert len(view) == 0


def test_a_gap_in_the_sequence_empties_the_view() -> None:
    view = KvBlocks()
    apply_batch(
        view,
        "m",
        5,
        batch(
            {
                "type": "BlockStored",
                "block_hashes": [11],
                "parent_block_hash": None,
                "token_ids": TOKENS[:16],
                "block_size": 16,
            }
        ),
    )
    assert len(view) == 1
    apply_batch(view, "m", 7, batch())  # 6 was lost
    assert len(view) == 0 and view.resets == 1


def test_garbage_is_refused_not_raised_through() -> None:
    view = KvBlocks()
    for payload in (b"\xc1", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0])):
        try:
            apply_batch(view, "m", 0, payload)
        except ValueError:
            continue
        raise AssertionError("garbage accepted")
    assert apply_batch(view, "m", 1, batch({"type": "Mystery"}, ["BlockStored"], 42)) == 0


async def test_the_pickers_view_follows_a_replicas_cache() -> None:
    kv_port, serving_port = free_port(), free_port()
    config = fast_config(cache=CacheConfig(block_size=16, num_gpu_blocks=64))
    async with run_sim(config, ports=[serving_port], kv_events_ports=[kv_port]) as (replica,):
        pool = Pool()
        pool.apply(ready=[replica.address])
        events = KvEvents(
            pool, AffinityConfig(prefix="precise", kv_events_port_offset=kv_port - serving_port)
        )
        task = asyncio.create_task(events.run())
        try:
            endpoint = pool.get(replica.address)
            assert endpoint is not None
            await async_wait_until(lambda: endpoint.kv is not None, 2, what="a subscriber")
            prompt = "p" * 640  # 160 tokens: 10 blocks
            keys = token_blocks(completion_tokens(prompt), 16, seed_of("tiny-llama"))
            async with http_client.AsyncClient(base_url=replica.url) as http:
                body = {"model": "tiny-llama", "max_tokens": 1}
                for i in range(100):  # until the subscription has reached the publisher (ZMQ)
                    await http.post("/v1/completions", json={**body, "prompt": f"{i:03d}" + "w" * 61})
                    if events.messages:
                        break
                    await asyncio.sleep(0.01)
                await http.post("/v1/completions", json={**body, "prompt": prompt})
                await async_wait_until(lambda: all(k in endpoint.kv for k in keys), 5, what="the blocks")
                await http.post(
                    "/v1/completions", json={**body, "prompt": "e" * 4096}
                )  # 64 blocks: evicts all
                await async_wait_until(lambda: not any(k in endpoint.kv for k in keys), 5, what="evictions")
                assert len(endpoint.kv) <= 64 and events.bad == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


# --- issue 40, item 11: one malformed message must not stop precise affinity ----------------------


def test_a_map_with_an_array_key_is_refused_as_garbage() -> None:
    payload = b"\x92\xcb?\xf0\x00\x00\x00\x00\x00\x00\x91\x81\x91\x01\x01"  # [1.0, [{[1]: 1}]]
    view = KvBlocks()
    try:
        apply_batch(view, "m", 0, payload)
    except ValueError:
        return
    raise AssertionError("an unhashable map key was not refused as ValueError")


def test_an_unhashable_block_name_applies_nothing_of_its_event() -> None:
    view = KvBlocks()
    stored = ["BlockStored", [11, [12], 13, 14], None, TOKENS, 16, None, "GPU"]
    assert apply_batch(view, "m", 0, batch(stored)) == 0
    assert len(view) == 0  # before: block 11 was keyed, then [12] raised, half applied


async def test_a_reader_survives_a_bad_message_and_a_dead_one_is_restarted() -> None:
    pool = Pool()
    pool.apply(ready=["127.0.0.1:1"])
    events = KvEvents(pool, AffinityConfig(prefix="precise", kv_events_port_offset=1))
    endpoint = pool.get("127.0.0.1:1")
    assert endpoint is not None
    endpoint.kv = KvBlocks()
    events._message(
        "127.0.0.1:1",
        [b"kv@x@m", (0).to_bytes(8, "big"), b"\x92\xcb?\xf0\x00\x00\x00\x00\x00\x00\x91\x81\x91\x01\x01"],
    )
    assert events.bad == 1 and events.rejected == {"not-a-batch": 1}
    events.reconcile()
    (task,) = events._followers.values()
    task.cancel()  # as a reader that died
    await asyncio.gather(task, return_exceptions=True)
    events.reconcile()
    (again,) = events._followers.values()
    assert again is not task and not again.done()  # before: the dead task was kept for good
    again.cancel()
    await asyncio.gather(again, return_exceptions=True)
    events._context.term()
