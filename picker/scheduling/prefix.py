"""Prompt block hashes: what a request shares with what a replica has cached, as chained block keys.

Approximate (no engine support): the prompt's material (picker/request/inference.py) is cut into blocks of
`block_tokens` pseudo-tokens of `bytes_per_token` bytes each (the reference picker packs 4 bytes into
one pseudo-token and uses blocks of at least 64). Full blocks only, unlike the reference, which
hashes the partial last block too: an engine caches full blocks only, so a prompt shorter than a
block shares nothing an engine could hold, and is spread by load. Precise: the engine's own token
ids, in blocks of the engine's block size (full blocks only too). Either way each key covers its
block and every block before it (a chain), seeded with the model name and the request's
`cache_salt`, so two requests share a key exactly when they share the whole prefix up to it.

xxHash (XXH3, 64-bit; the `xxhash` package): the fastest well-kept hash of its kind, so that a long
prompt's keys cost little beside the pick (loadtest/bench_prefix.py).
Pure functions, no I/O.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Sequence

import xxhash

MIN_BLOCK_TOKENS = 64  # smaller blocks cost index memory for little more precision (the reference's floor)


def seed_of(model: str, cache_salt: str | None = None) -> int:
    """The chain's seed: a prefix is only shared by requests of the same model and salt."""
    text = model if cache_salt is None else f"{model}\x1f{cache_salt}"
    return xxhash.xxh3_64_intdigest(text.encode())


def prompt_blocks(material: bytes, block_bytes: int, seed: int, max_blocks: int) -> tuple[int, ...]:
    """Chained keys of `material`'s full blocks of `block_bytes`, at most `max_blocks`.

    A key is the hash of everything up to the end of its block (one running hash, read at each
    block end), which is the chain of block hashes in one pass over the bytes.
    """
    if len(material) < block_bytes:
        return ()
    running = xxhash.xxh3_64(seed=seed)
    out = []
    view = memoryview(material)
    end = min(len(material) - block_bytes, block_bytes * (max_blocks - 1))
    for start in range(0, end + 1, block_bytes):
        running.update(view[start : start + block_bytes])
        out.append(running.intdigest())
    return tuple(out)


def token_blocks(tokens: Sequence[int], block_tokens: int, seed: int) -> tuple[int, ...]:
    """Chained keys of full blocks of engine token ids (the engine caches full blocks only)."""
    return chain_tokens(seed, tokens, block_tokens)


def chain_tokens(parent: int, tokens: Sequence[int], block_tokens: int) -> tuple[int, ...]:
    """Keys of the full blocks of `tokens`, chained from `parent` (a seed, or the key before them)."""
    try:
        data = memoryview(array.array("I", tokens).tobytes())  # one conversion, then slices
    except OverflowError:  # a token id past 2**32: no engine has one
        return ()
    step = block_tokens * 4
    out = []
    key = parent
    for start in range(0, len(data) - step + 1, step):
        key = xxhash.xxh3_64_intdigest(data[start : start + step], seed=key)
        out.append(key)
    return tuple(out)


def matched(blocks: Sequence[int], has: Callable[[int], bool]) -> int:
    """How many leading blocks `has` (greedy: the first miss ends the match, as a prefix cache does)."""
    count = 0
    for block in blocks:
        if not has(block):
            break
        count += 1
    return count
