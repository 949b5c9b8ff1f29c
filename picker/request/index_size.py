"""How large each endpoint's approximate prefix index is: its engine's cache, in the index's blocks.

The index cuts a prompt into blocks of `block_tokens` pseudo-tokens (its bytes / bytes_per_token);
an engine's cache holds `num_blocks` x `block_size` of its own tokens, and a real tokenizer's tokens
are not the index's (often several to a pseudo-token). Sized in pseudo-tokens alone,
the index believes an engine holds several times what it keeps, and a prefix it no longer holds
still reads as held. So the engines' tokens per pseudo-token are learned from the prompt sizes they
report (usage.prompt_tokens), and each index follows its engine's published cache in those terms.
No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from picker.pool import Endpoint

MAX_RATIO = 8.0  # engine tokens per pseudo-token believed at most (and its inverse at least)
_KEEP = 0.95  # each report keeps this much of the sums before it (about the last 20 reports)
_SLACK = 0.05  # an index is resized when its bound is this far from what it should be


@dataclass(slots=True)
class TokenRatio:
    """The engines' tokens per pseudo-token, over the recent reports weighted by their size: a short
    chat prompt whose template doubles it weighs as little as its tokens, not as much as a long one."""

    reported: float = 0.0  # decayed sums of the engines' prompt sizes and the index's estimates
    estimated: float = 0.0

    @property
    def value(self) -> float:
        if self.estimated <= 0:
            return 1.0
        return min(MAX_RATIO, max(1.0 / MAX_RATIO, self.reported / self.estimated))

    def add(self, prompt_tokens: int, estimated_tokens: int) -> None:
        """One engine's report of a prompt's size (`estimated_tokens`: the index's)."""
        self.reported = self.reported * _KEEP + prompt_tokens
        self.estimated = self.estimated * _KEEP + estimated_tokens


def capacity(endpoint: Endpoint, block_tokens: int, ratio: float, default: int) -> int:
    """The engine's cache in the index's blocks when it publishes it, else `default`."""
    if endpoint.num_blocks and endpoint.block_size:
        blocks = endpoint.num_blocks * endpoint.block_size / (ratio * block_tokens)
        return max(1, int(blocks + 1e-6))  # a ratio learned as 2.5000000001 is 2.5
    return default


def follow(endpoints: Iterable[Endpoint], block_tokens: int, ratio: float) -> None:
    """Each index follows its engine's published cache (not at every wobble of the ratio)."""
    for endpoint in endpoints:
        index = endpoint.prefix
        if index is not None and endpoint.num_blocks:
            wanted = capacity(endpoint, block_tokens, ratio, index.bound)
            if abs(wanted - index.bound) > _SLACK * index.bound:
                index.resize(wanted)
