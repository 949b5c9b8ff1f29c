"""How large each endpoint's approximate prefix index is: its engine's cache, in the index's blocks.

The index cuts a prompt into blocks of `block_tokens` pseudo-tokens (its bytes / bytes_per_token);
an engine's cache holds `num_blocks` x `block_size` of its own tokens, and a real tokenizer's tokens
are not the index's (a third of a pseudo-token each for some prompts). Sized in pseudo-tokens alone,
the index believes an engine holds several times what it keeps, and a prefix it no longer holds
still reads as held. So the engines' tokens per pseudo-token are learned from the prompt sizes they
report (usage.prompt_tokens), and each index follows its engine's published cache in those terms.
No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from picker.pool import Endpoint

MAX_RATIO = 8.0  # engine tokens per pseudo-token believed at most (and its inverse at least)
_STEP = 0.1  # how far one report moves the learned ratio
_SLACK = 0.05  # an index is resized when its bound is this far from what it should be


def learned(ratio: float, prompt_tokens: int, estimated_tokens: int) -> float:
    """The ratio after one engine's report of a prompt's size (`estimated_tokens`: the index's)."""
    seen = min(MAX_RATIO, max(1.0 / MAX_RATIO, prompt_tokens / estimated_tokens))
    return ratio + _STEP * (seen - ratio)


def capacity(endpoint: Endpoint, block_tokens: int, ratio: float, default: int) -> int:
    """The engine's cache in the index's blocks when it publishes it, else `default`."""
    if endpoint.num_blocks and endpoint.block_size:
        return max(1, int(endpoint.num_blocks * endpoint.block_size / ratio // block_tokens))
    return default


def follow(endpoints: Iterable[Endpoint], block_tokens: int, ratio: float) -> None:
    """Each index follows its engine's published cache (not at every wobble of the ratio)."""
    for endpoint in endpoints:
        index = endpoint.prefix
        if index is not None and endpoint.num_blocks:
            wanted = capacity(endpoint, block_tokens, ratio, index.bound)
            if abs(wanted - index.bound) > _SLACK * index.bound:
                index.resize(wanted)
