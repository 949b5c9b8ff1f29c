"""What each endpoint holds in its prefix cache, as the picker knows it: two views, one per mode.

- `PrefixIndex` (approximate): the block keys of the prompts routed to the endpoint (learned at the
  pick, as the reference picker does), bounded like the engine's cache. Recency in two generations:
  blocks routed since the last rotation, and those of the generation before; when the newer one
  reaches the capacity, the older one goes in one step. The `capacity` most recently routed blocks
  always stay (up to twice as many may). Exact LRU per block (an ordered map, or an index swept by
  age) costs about twice the memory a block and several times the time a prompt
  (loadtest/bench_prefix.py). The engine's own word corrects it (`observed`): many prompts reported
  with fewer cached tokens than the index predicted mean the engine evicts sooner than the index
  assumed, so the capacity shrinks; none lets it grow back up to its bound.
- `KvBlocks` (precise): the blocks the engine reports it holds through its KV events
  (picker/sources/kv_events.py): `BlockStored` adds, `BlockRemoved` removes, `AllBlocksCleared` and
  a gap in the event sequence numbers empty it (it will be rebuilt by new events). Keys are the
  picker's own (picker/scheduling/prefix.py `chain_tokens` over the blocks' token ids), so they match
  what a request's token ids hash to; the engine's block hashes are only names.
Plain data on one event loop, no I/O; the pool drops both when an endpoint becomes GONE.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

DEFAULT_CAPACITY = 31_250  # blocks per endpoint (the reference's lruCapacityPerServer)
_MIN_CAPACITY = 4  # blocks: a tiny cache (a test engine's) is still sized as it is
_FEEDBACK_WINDOW = 50  # engine reports judged together (PrefixIndex.observed)


class PrefixIndex:
    """The approximate view of one endpoint's cache."""

    __slots__ = ("_both", "_emptied", "_new", "_old", "_over", "_seen", "bound", "capacity")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.bound = max(_MIN_CAPACITY, capacity)  # the engine's size (num_gpu_blocks) or the default
        self.capacity = self.bound  # what the index keeps now (corrected by `observed`)
        # block -> when it was last routed here (`add`'s stamp): since the last rotation, and before
        self._new: dict[int, int] = {}
        self._old: dict[int, int] = {}
        self._both = 0  # blocks in both generations, counted once by `__len__`
        # the engine's reports in this window, how many fell short, and how many found nothing at all
        self._seen = self._over = self._emptied = 0

    def __len__(self) -> int:
        """The blocks held: kept as a count, for every pick asks it of every candidate (its room)."""
        return len(self._new) + len(self._old) - self._both

    def __contains__(self, key: int) -> bool:
        return key in self._new or key in self._old

    def matched(self, keys: Sequence[int]) -> int:
        """How many of a prompt's chained block keys, from the first, the index holds.

        A binary search, exact because the index is prefix-closed: `add` takes a prompt's keys from
        the first, and a key of a chain is in every prompt its later keys are in, so it was routed
        at least as lately as they were; a generation goes whole, so no key outlives the keys before
        it. One block size an index (Placement.dispatched adds no keys cut at another). About 12
        lookups for a 220 KB prompt's 3,400 blocks, not 3,400.
        """
        new, old = self._new, self._old
        low, high = 0, len(keys)  # keys[:low] are held; keys[high] is not
        while low < high:
            middle = (low + high) // 2
            key = keys[middle]
            if key in new or key in old:
                low = middle + 1
            else:
                high = middle
        return low

    def routed_at(self, keys: Sequence[int], held: int) -> int:
        """When the deepest of the `held` leading keys (`matched`'s count) was last routed here; 0
        when none is. Where several endpoints hold the same prefix by the index, the engine that took
        it last is the one whose cache still has it: an index that believes more than the engine
        keeps (pseudo-tokens, a smaller cache) goes wrong on the older holders first."""
        if held <= 0:
            return 0
        key = keys[held - 1]
        return self._new.get(key) or self._old.get(key, 0)

    def add(self, keys: Sequence[int], stamp: int = 1) -> None:
        """A prompt was routed here (`stamp`: a clock that grows with every routing, the pool's):
        its blocks are (or will be) in the engine's cache."""
        new, old = self._new, self._old
        if old:
            # the prompt's blocks the older generation holds that the newer one does not yet: now
            # in both (set operations on the dicts' key views, in C, each over the smaller side)
            held = old.keys() & keys
            if held:
                self._both += len(held) - len(new.keys() & held)
        new.update(dict.fromkeys(keys, stamp))  # in C: about 20 ns a block
        if len(new) >= self.capacity:
            self._old, self._new = new, {}  # the older generation goes, in one step
            self._both = 0

    def observed(self, predicted_blocks: int, cached_blocks: int) -> None:
        """The engine reported how much of a prompt it had cached; the index had predicted this much.

        Judged over windows of reports, not one by one: a single short one is often no fault of the
        index (a block evicted a moment ago). When most of a window's reports found nothing cached at
        all, the engine's cache was emptied (a restart, a reset): the index empties too. When more
        than a quarter fall short, the engine evicts sooner than the index assumes: it keeps a tenth
        less. A window with almost none (one in twenty) lets it grow back a tenth, up to its bound.
        """
        self._seen += 1
        short = cached_blocks < predicted_blocks
        self._over += short
        self._emptied += short and cached_blocks == 0
        if self._seen < _FEEDBACK_WINDOW:
            return
        if self._emptied * 2 > self._seen:
            self.clear()
        elif self._over * 4 > self._seen:
            self.capacity = max(_MIN_CAPACITY, int(self.capacity * 0.9))
        elif self._over * 20 <= self._seen:
            self.capacity = min(self.bound, int(self.capacity * 1.1) + 1)
        self._seen = self._over = self._emptied = 0

    def resize(self, bound: int) -> None:
        """The engine's cache, in this index's blocks, is `bound` (its published num_gpu_blocks, in
        the prompt's own tokens): what the index keeps follows in proportion (its feedback kept)."""
        bound = max(_MIN_CAPACITY, bound)
        self.capacity = max(_MIN_CAPACITY, min(bound, round(self.capacity * bound / self.bound)))
        self.bound = bound

    def clear(self) -> None:
        self._new.clear()
        self._old.clear()
        self._both = 0


class KvBlocks:
    """The precise view of one endpoint's cache, from its KV events."""

    __slots__ = ("_keys", "_names", "block_size", "last_sequence", "resets")

    def __init__(self) -> None:
        self._keys: dict[int, object] = {}  # picker key -> the engine's block hash (its name)
        self._names: dict[object, int] = {}  # the engine's block hash (int or bytes) -> picker key
        self.block_size: int | None = None  # the engine's, from its BlockStored events
        self.last_sequence: int | None = None
        self.resets = 0  # times the view was emptied (cleared, or a gap in the sequence)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def matched(self, keys: Sequence[int]) -> int:
        """How many of a prompt's chained block keys, from the first, the engine holds. A walk to the
        first miss: an engine evicts blocks in its own order, so what it holds may have holes."""
        held = self._keys
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def key_of(self, name: object) -> int | None:
        """The picker's key of a block the engine names (a parent of newly stored blocks)."""
        return self._names.get(name)

    def stored(self, names: Sequence[object], keys: Sequence[int]) -> None:
        for name, key in zip(names, keys, strict=False):
            self._keys[key] = name
            self._names[name] = key

    def removed(self, names: Iterable[object]) -> None:
        for name in names:
            key = self._names.pop(name, None)
            if key is not None:
                self._keys.pop(key, None)

    def sequence(self, number: int) -> bool:
        """A batch's sequence number; False (and the view emptied) when batches were lost before it."""
        last, self.last_sequence = self.last_sequence, number
        if last is not None and number != last + 1:
            self.reset()
            return False
        return True

    def reset(self) -> None:
        self._keys.clear()
        self._names.clear()
        self.resets += 1


@dataclass(frozen=True, slots=True)
class CacheKeys:
    """What one request looks up in the endpoints' caches, computed once at admission."""

    blocks: tuple[int, ...] = ()  # approximate: chained keys of the prompt's pseudo-token blocks
    tokens: tuple[int, ...] = ()  # precise: chained keys of the engine's token blocks (KV events)
    estimated_tokens: int = 0  # the prompt's size in (pseudo-)tokens
    model: str = ""  # the model or LoRA adapter it names
    session: str | None = None  # the session it belongs to (scheduling.session_header)
    block_tokens: int = 0  # approximate: the block size `blocks` were cut at

    def cached_fraction(self, endpoint: CacheView) -> float:
        """How much of the prompt `endpoint` is known to hold: 0 (nothing) to 1 (all of it)."""
        if self.tokens and endpoint.kv is not None:
            return endpoint.kv.matched(self.tokens) / len(self.tokens)
        if self.blocks and endpoint.prefix is not None:
            return endpoint.prefix.matched(self.blocks) / len(self.blocks)
        return 0.0

    def holding(self, endpoint: CacheView) -> tuple[float, int]:
        """`cached_fraction`, and when that much of the prompt was last routed to `endpoint`
        (approximate: `PrefixIndex.routed_at`; 0 when unknown, as with the engines' own KV events,
        which say what is held, not guessed)."""
        if self.tokens and endpoint.kv is not None:
            return endpoint.kv.matched(self.tokens) / len(self.tokens), 0
        index = endpoint.prefix
        if self.blocks and index is not None:
            held = index.matched(self.blocks)
            return held / len(self.blocks), index.routed_at(self.blocks, held)
        return 0.0, 0


class CacheView(Protocol):
    @property
    def prefix(self) -> PrefixIndex | None: ...

    @property
    def kv(self) -> KvBlocks | None: ...
