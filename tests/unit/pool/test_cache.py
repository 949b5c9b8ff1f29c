"""How much of a prompt each cache view holds: the approximate index's binary search against the walk
to the first miss it replaces, and the precise view's walk across an engine's holes."""

from __future__ import annotations

import random

from picker.pool.cache import KvBlocks, PrefixIndex
from picker.scheduling.prefix import prompt_blocks

_BLOCK = 16


def _walk(index: PrefixIndex, keys: tuple[int, ...]) -> int:
    """The reference: keys held from the first, up to the first one missing."""
    count = 0
    for key in keys:
        if key not in index:
            break
        count += 1
    return count


def _prompts(rng: random.Random, count: int) -> list[tuple[int, ...]]:
    """Prompts that share prefixes as chats and system prompts do: each extends or branches another."""
    texts = [b"system: be brief. " * 4]
    for _ in range(count):
        base = rng.choice(texts)
        cut = rng.randrange(0, len(base) + 1)
        texts.append(base[:cut] + bytes(rng.randrange(97, 123) for _ in range(rng.randrange(1, 120))))
    return [prompt_blocks(text, _BLOCK, 7, 64) for text in texts]


def test_the_index_finds_what_a_walk_to_the_first_miss_finds_through_every_rotation() -> None:
    rng = random.Random(56)
    prompts = _prompts(rng, 400)
    index = PrefixIndex(capacity=64)  # a few prompts a generation: hundreds of rotations
    checked = partial = 0
    for _ in range(3000):
        index.add(rng.choice(prompts))
        for keys in rng.sample(prompts, 8):
            held = _walk(index, keys)
            assert index.matched(keys) == held
            checked += 1
            partial += 0 < held < len(keys)
    assert partial > checked // 10  # prefixes held in part, not only all or nothing
    assert index.matched(()) == 0


def test_the_index_counts_each_block_it_holds_once_through_rotations_and_clears() -> None:
    rng = random.Random(63)
    prompts = _prompts(rng, 300)
    index = PrefixIndex(capacity=48)
    newer: set[int] = set()  # the reference: the two generations, kept as the docstring says
    older: set[int] = set()
    for step in range(4000):
        keys = rng.choice(prompts)
        index.add(keys)
        newer.update(keys)
        if len(newer) >= 48:  # the newer generation is full: the older one goes whole
            older, newer = newer, set()
        if step % 997 == 996:
            index.clear()
            newer.clear()
            older.clear()
        assert len(index) == len(newer | older)


def test_the_engines_view_stops_at_its_first_hole() -> None:
    blocks = KvBlocks()
    keys = (11, 12, 13, 14, 15)
    blocks.stored(["a", "b", "c", "d", "e"], keys)
    assert blocks.matched(keys) == 5
    blocks.removed(["c"])  # an engine evicts in its own order: the blocks after a hole still held
    assert 14 in blocks and 15 in blocks
    assert blocks.matched(keys) == 2
    assert blocks.matched((99, 11)) == 0
