"""The choice over facts given per candidate (`Affinity`), for callers that have them already.

The request path builds its rows itself (picker/scheduling/rows.py) and goes straight to the choice
(picker/scheduling/choice.py); this takes a candidate list with what the request would find on each
(the cached share, LoRA, session, the predictions), makes the same rows and asks the same choice.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from picker.scheduling.choice import AffinityPolicy, Choice, choose
from picker.scheduling.load import LoadPolicy, busy_when, measure
from picker.scheduling.pick import Candidate, Stagger
from picker.scheduling.rows import Row, lora_score

__all__ = ["Affinity", "AffinityPolicy", "Choice", "lora_score", "pick_with_affinity"]


@dataclass(frozen=True, slots=True)
class Affinity:
    """What one request would find on one candidate."""

    cached: float = 0.0  # share of the prompt held there (0-1)
    lora: float = 0.0  # 1 adapter running, 0.8 a free adapter slot, 0.6 adapter waiting, 0 none
    session: bool = False  # the request's session is bound there
    # prefill tokens it would wait for there: the candidate's backlog plus its own uncached tokens
    prefill: float = 0.0
    room: float = 1.0  # the share of the candidate's cache not yet known to be taken (0-1)
    load_avg: float = 0.0  # its load averaged over the last seconds (sustained, not a swing)
    # the latency model's predicted seconds to this request's first token, and per output token
    ttft_s: float | None = None
    tpot_s: float | None = None
    # ... and to its last token (TTFT + TPOT x the tokens it asks for): what the pick minimizes
    latency_s: float | None = None


def pick_with_affinity(
    candidates: Sequence[Candidate],
    affinities: Sequence[Affinity],
    count: int,
    rng: random.Random,
    now: float,
    load: LoadPolicy,
    policy: AffinityPolicy,
    last_resort: frozenset[str] = frozenset(),
    stagger: Stagger | None = None,
    slo: tuple[float | None, float | None] | None = None,
    ahead: int = 0,
) -> Choice:
    """Up to `count` addresses, primary first; no destinations when no candidate has room.

    With `stagger` (several pickers), loads compare in whole requests and ties go by the picker's
    own order (`Stagger`), not at random. `slo`: the request's (TTFT, TPOT) objectives in seconds.
    `ahead`: the requests waiting in the picker ahead of this one."""
    if count <= 0 or not candidates:
        return Choice([], "")
    order = stagger.order([c.address for c in candidates]) if stagger is not None else None
    rows = []
    for candidate, a in zip(candidates, affinities, strict=True):
        address = candidate.address
        full, cost, current = measure(candidate, now, load)
        if order is not None:
            cost, tiebreak = Stagger.whole(cost, load), float(order[address])
        else:
            tiebreak = rng.random()
        busy = busy_when(candidate, now, load, full)
        suspect = address in last_resort
        row = Row(address, suspect, full, busy, cost, tiebreak, current, a.load_avg, a.cached, a.lora)
        row.session, row.prefill, row.room = a.session, a.prefill, a.room
        row.ttft_s, row.tpot_s, row.latency_s = a.ttft_s, a.tpot_s, a.latency_s
        rows.append(row)
    rows.sort(key=lambda row: row.order)
    return choose(rows, count, policy, slo, ahead)
