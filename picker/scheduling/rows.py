"""The pick's rows: one per candidate, computed once, everything the filters and scorers read.

A pick reads one way (docs/design.md, "Routing"): the request as the pick sees it (`Ask`), one `Row`
per READY candidate built here (its state, load and slots, the cached share of the prompt, the
predicted times, LoRA, session), then the filters (picker/scheduling/filters.py), the scorers
(picker/scheduling/scorers.py) and the choice (picker/scheduling/choice.py), none of which asks
the view or the models again. Every per-candidate figure is computed in this module, once per pick.
No I/O; the only write is the candidate's load average (`_averaged`), which the pick keeps.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from picker.pool import Endpoint
from picker.pool.cache import CacheKeys
from picker.scheduling.latency import LatencyModel
from picker.scheduling.load import LoadPolicy, busy_when, measure
from picker.scheduling.pick import Stagger

# the output a request that sets no max_tokens is expected to ask for, and the most any request is
# expected to produce (a huge max_tokens usually ends at a stop long before)
DEFAULT_OUTPUT_TOKENS = 128
MAX_OUTPUT_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class Ask:
    """One request as the pick sees it."""

    keys: CacheKeys | None = None  # its cache keys (None: nothing to look up)
    model: str = ""  # the model or adapter it names
    lora: bool = False  # some candidate runs or queues that adapter: LoRA affinity applies
    bound: str | None = None  # the endpoint its session is bound to
    out_tokens: int = DEFAULT_OUTPUT_TOKENS  # the output it is expected to ask for
    slo: tuple[float | None, float | None] | None = None  # its (TTFT, TPOT) objectives, seconds
    # 0-1: how far it keeps off the pods a scale-down takes next (kube.deletion_cost): its expected
    # run against scale_down.steer_s (a short one little); 0 with nothing ranked
    steer: float = 0.0

    @property
    def size(self) -> float:
        """Its prompt's estimated tokens."""
        return self.keys.estimated_tokens if self.keys is not None else 0


def output_tokens(max_tokens: int | None) -> int:
    return min(max_tokens or DEFAULT_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)


def steer(max_tokens: int | None, steer_tokens: int) -> float:
    """How far a request keeps off the next scale-down's victims: in full from `steer_tokens` asked
    (scale_down.steer_s in tokens at the pool's pace), in proportion below; uncapped, unlike
    `output_tokens`: a long max_tokens is what makes a drain long."""
    return min(1.0, (max_tokens or DEFAULT_OUTPUT_TOKENS) / max(1, steer_tokens))


@dataclass(slots=True)
class Row:
    """One candidate, as every filter and scorer of one pick reads it."""

    address: str
    suspect: bool  # failing fast: last resort only
    full: bool  # saturated: no room for one more
    busy: bool  # saturated only because every batch slot is taken (waiting for one is a choice)
    cost: float  # the load score (lower is better; in whole requests with a stagger)
    tiebreak: float  # random, or this picker's own order with a stagger
    load: float  # requests the engine holds now (estimated)
    load_avg: float = 0.0  # its load averaged over the last seconds (sustained, not a swing)
    cached: float = 0.0  # share of the prompt held there (0-1)
    lora: float = 0.0  # 1 adapter running, 0.8 a free adapter slot, 0.6 adapter waiting, 0 none
    session: bool = False  # the request's session is bound there
    # prefill tokens it would wait for there: the candidate's backlog plus its own uncached tokens
    prefill: float = 0.0
    room: float = 1.0  # the share of the candidate's cache not yet known to be taken (0-1)
    # when the prefix it holds was last routed there (approximate; higher is later, 0 unknown)
    routed: int = 0
    # the latency model's predicted seconds to this request's first token, per output token, and its
    # cost there (TTFT + TPOT x the tokens it asks for + what the streams running there lose to it:
    # what the pick minimizes); None: not used
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    # the features of those predictions (what the model learns from once the request is served)
    ttft_x: tuple[float, float, float] | None = None
    tpot_x: tuple[float, float] | None = None
    # the ask's steer x where its pod stands in the next scale-down (0: deleted first, 1: last)
    stays: float = 0.0

    @property
    def order(self) -> tuple[bool, bool, float, float]:
        """`pick`'s order: suspects last, saturated after those with room, then by load."""
        return self.suspect, self.full, self.cost, self.tiebreak


def build(
    candidates: Sequence[Endpoint],
    ask: Ask,
    now: float,
    policy: LoadPolicy,
    rng: random.Random,
    *,
    suspects: frozenset[str] = frozenset(),
    stagger: Stagger | None = None,
    window_s: float,
    latency: LatencyModel | None = None,
    next_to_go: Mapping[str, float] | None = None,
) -> list[Row]:
    """The rows of one pick, in `pick`'s order. With `latency`, each row carries its predictions;
    with `next_to_go` (pool/deletion_rank.py) and an ask that steers, where its pod stands."""
    order = stagger.order([c.address for c in candidates]) if stagger is not None else None
    keys, bound, size = ask.keys, ask.bound, ask.size
    rows = []
    for c in candidates:
        address = c.address
        full, cost, current = measure(c, now, policy)
        if order is not None:
            cost, tiebreak = Stagger.whole(cost, policy), float(order[address])
        else:
            tiebreak = rng.random()
        cached, routed = keys.holding(c) if keys is not None else (0.0, 0)
        adapter = 0.0
        if ask.lora:
            adapter = lora_score(ask.model, c.running_adapters, c.waiting_adapters, c.max_adapters)
        uncached = size * (1.0 - cached)
        row = Row(
            address,
            address in suspects,
            full,
            busy_when(c, now, policy, full),
            cost,
            tiebreak,
            current,
            _averaged(c, current, now, window_s),
            cached,
            adapter,
            address == bound,
            c.pending_prefill + uncached,
            _room(c),
            routed,
        )
        if latency is not None:
            row.ttft_s, row.tpot_s, row.ttft_x, row.tpot_x = predict(latency, c, current, uncached, policy)
            # what the request costs there: its own time to its last token, and the time the streams
            # decoding there lose to it (their remaining tokens, about half a stream, that overlap its
            # own): a quick replica that is busy costs more than its own prediction says, so a slower
            # one with room takes work once the quick ones are loaded (what it can serve), not only
            # when they are full
            overlap = min(float(ask.out_tokens), latency.output_tokens / 2)
            running = min(current, _slots(c, current, policy))
            others = latency.slowdown(address, running, overlap)
            row.latency_s = row.ttft_s + row.tpot_s * ask.out_tokens + others
        if ask.steer and next_to_go:
            row.stays = ask.steer * next_to_go.get(address, 0.0)  # not ranked yet: none reads as 0
        rows.append(row)
    rows.sort(key=_order)
    return rows


def _order(row: Row) -> tuple[bool, bool, float, float]:
    return row.suspect, row.full, row.cost, row.tiebreak


def lora_score(
    model: str, running: frozenset[str], waiting: frozenset[str], max_adapters: int | None
) -> float:
    """The reference's LoRA affinity: running 1, a free slot 0.8, waiting 0.6, else 0."""
    if max_adapters is None:
        return 0.0
    if model in running:
        return 1.0
    if len(running | waiting) < max_adapters:
        return 0.8
    if model in waiting:
        return 0.6
    return 0.0


def _room(endpoint: Endpoint) -> float:
    """The share of an endpoint's cache not known to be taken: by its KV events, else its index."""
    if endpoint.kv is not None and endpoint.num_blocks:
        return max(0.0, 1.0 - len(endpoint.kv) / endpoint.num_blocks)
    if endpoint.prefix is not None:
        return max(0.0, 1.0 - len(endpoint.prefix) / endpoint.prefix.capacity)
    return 1.0


def _averaged(endpoint: Endpoint, load: float, now: float, window_s: float) -> float:
    """The endpoint's load averaged over about `window_s` seconds (an exponential moving average)."""
    at = endpoint.load_avg_at
    if at is None:
        endpoint.load_avg = load
    elif now > at:
        endpoint.load_avg += (1.0 - math.exp((at - now) / window_s)) * (load - endpoint.load_avg)
    endpoint.load_avg_at = now
    return endpoint.load_avg


def _queued_ahead(endpoint: Endpoint, load: float, policy: LoadPolicy) -> float:
    """Requests that would wait on the engine ahead of one more: its queue now, plus this one's own
    wait when every slot is taken (slots configured or learned; else the scrape's queue alone)."""
    slots = policy.engine_slots or endpoint.learned_slots
    if slots:
        return max(0.0, load + 1.0 - slots)
    sample = endpoint.load  # slots unknown: the scrape's queue (what `estimated_waiting` says then)
    return 0.0 if sample is None else sample.waiting


def _slots(endpoint: Endpoint, load: float, policy: LoadPolicy) -> float:
    """The engine's batch slots: configured, learned, else at least what it runs now."""
    return float(policy.engine_slots or endpoint.learned_slots or max(1.0, load))


def predict(
    latency: LatencyModel, endpoint: Endpoint, load: float, uncached: float, policy: LoadPolicy
) -> tuple[float, float, tuple[float, float, float], tuple[float, float]]:
    """(TTFT, TPOT, their features) the model predicts for one more request of `uncached` prompt
    tokens on `endpoint`, which holds `load` requests now."""
    return latency.predict(
        endpoint.address,
        endpoint.pending_prefill + uncached,
        _queued_ahead(endpoint, load, policy),
        _slots(endpoint, load, policy),
        load + 1.0,
    )
