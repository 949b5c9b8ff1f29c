"""The simulator's tokenizer and prefix cache: what a vLLM replica has cached, block by block.

Tokenizer: deterministic and cheap. Text becomes one token per 4 characters (the simulator's prompt
token count was always ceil(chars / 4)); a chat request is ChatML-like (start, role, newline, content,
end per message, then the assistant turn: the 4-per-message and 2-per-request overhead the count had),
with the JSON of `tools` first. `POST /tokenize` answers with these ids, as vLLM's does with its own.

Cache: vLLM's automatic prefix caching over full blocks of `block_size` tokens. A block's hash chains
its parent's hash, its tokens and (on the first block) the request's `cache_salt`; a request hits the
longest run of leading full blocks the cache holds. Blocks live in an LRU of `num_blocks` entries
(running requests do not pin theirs: a simplification). Storing a prompt reports the blocks stored and
evicted, which the KV-event publisher sends as vLLM's `BlockStored` / `BlockRemoved`.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

_VOCAB = 50_000
VOCAB_SIZE = 100 + _VOCAB  # ids 1-4 are the chat template's, text tokens are 100 and up
IM_START, IM_END, NEWLINE, ASSISTANT = 1, 2, 3, 4
_MASK = (1 << 63) - 1


def text_tokens(text: str) -> list[int]:
    """One token per 4 characters, at least one for a non-empty text."""
    return [100 + zlib.crc32(text[i : i + 4].encode()) % _VOCAB for i in range(0, len(text), 4)] or [100]


def context_key(context: Sequence[int]) -> bytes:
    """The part of a context the next token depends on: its last 8 tokens, 4 bytes each."""
    return b"".join((t & 0xFFFFFFFF).to_bytes(4, "little") for t in context[-8:])


def next_token(context: Sequence[int]) -> int:
    """Greedy decoding, simulated: the next token is a function of the last 8 tokens of the context
    (prompt and generated so far), so a generation continued from its prompt plus its first k tokens
    yields exactly the tokens the uncut one did, as vLLM's greedy decoding does."""
    return 100 + zlib.crc32(context_key(context)) % _VOCAB


def token_text(token: int) -> str:
    """The text of one generated token on the sampled path (sim/vllm_sim/sampled_stream.py: requests
    with `return_token_ids`, stop strings, logprobs...); plain streams send " tok" per token."""
    return f" t{token}"


def completion_tokens(prompt: Any) -> list[int]:
    """A completions prompt (text, or token ids, or a one-element list of either) as token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return []


def chat_tokens(messages: Sequence[Any], tools: Any = None) -> list[int]:
    """A chat request rendered ChatML-like: 4 tokens around each message's content, 2 for the reply."""
    out: list[int] = text_tokens(json.dumps(tools, separators=(",", ":"))) if tools else []
    for message in messages:
        role = message.get("role", "") if isinstance(message, dict) else ""
        content = message.get("content") if isinstance(message, dict) else None
        out += [IM_START, 100 + zlib.crc32(str(role).encode()) % _VOCAB, NEWLINE]
        if isinstance(content, str):
            out += text_tokens(content) if content else []
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    out += text_tokens(part["text"])
        out.append(IM_END)
    return [*out, IM_START, ASSISTANT]


def block_hashes(tokens: Sequence[int], block_size: int, salt: str | None = None) -> list[int]:
    """The chained hash of each full block (vLLM hashes full blocks only)."""
    parent = zlib.crc32(salt.encode()) if salt else 0
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash((parent, tuple(tokens[start : start + block_size]))) & _MASK
        out.append(parent)
    return out


@dataclass
class Segment:
    """Consecutive new blocks: their hashes, the hash of the block before them, their tokens."""

    parent: int | None
    hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class Stored:
    """What one `store` changed: runs of new blocks (one `BlockStored` each) and the evicted blocks."""

    segments: list[Segment] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


class PrefixCache:
    """Block hashes present on one replica, least recently used first."""

    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up (vllm:prefix_cache_queries_total)
        self.hits = 0  # of them found cached (vllm:prefix_cache_hits_total)

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, tokens: Sequence[int], salt: str | None = None) -> int:
        """Tokens of the longest cached run of leading full blocks; counts the query and the hit."""
        hit = 0
        for block in block_hashes(tokens, self.block_size, salt):
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            hit += self.block_size
        self.queries += len(tokens)
        self.hits += hit
        return hit

    def store(self, tokens: Sequence[int], salt: str | None = None) -> Stored:
        """Cache every full block of `tokens`; the least recently used blocks make room."""
        stored = Stored()
        hashes = block_hashes(tokens, self.block_size, salt)
        previous: int | None = None
        run: Segment | None = None
        for index, block in enumerate(hashes):
            if block in self._blocks:
                self._blocks.move_to_end(block)
                run = None
            else:
                if run is None:
                    run = Segment(previous)
                    stored.segments.append(run)
                run.hashes.append(block)
                start = index * self.block_size
                run.token_ids += tokens[start : start + self.block_size]
                self._blocks[block] = None
            previous = block
        while len(self._blocks) > self.num_blocks:
            evicted, _ = self._blocks.popitem(last=False)
            stored.removed.append(evicted)
        return stored

    def clear(self) -> None:
        self._blocks.clear()
