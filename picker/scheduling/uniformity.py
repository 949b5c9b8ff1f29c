"""Whether the pool is uniform: the switch of `affinity.latency: auto`.

The latency model (picker/scheduling/latency.py) learns every replica's speed whatever the setting;
routing by its predictions helps only a pool whose replicas differ (another GPU, another version, a
noisy neighbour, fewer batch slots) and costs a uniform pool prefix hits and a few microseconds a
pick. So under `auto` the pick uses the predictions only while the pool measurably is not uniform.

Each replica's **speed** is what its fits predict for the pool's typical request where the pool
runs: its first token (the prefill tokens the pool was measured at lately), its time per output
token (beside as many running requests as the pool ran lately), and, where every replica's batch
slots are known, the wait for one at the pool's typical load (a replica with half the slots of the
rest is slower there, though no token of it is). A replica counts once it has observations of its
own on both figures; one the pick stopped feeding keeps the speed it was last measured at (it is
not uniform by going unmeasured) until it is measured again, drains or leaves the pool.

The **spread** is the largest gap between two groups: the replicas sorted by their time for the
typical request, split at every place, the slower group's median over the quicker group's. One slow
replica of four, half of them, or three of four read alike (against the median replica, a pool
half of whose replicas are slow reads as little different). A first token that is slower while
the decode is not is what a cache miss looks like, not a slower replica (an approximate index
wrong about what an engine holds makes a uniform pool's first tokens differ): the slower group's
first token counts above the quicker's only as far as its decode is slower too.

Engaged once the spread has stayed at or above `engage_ratio` for `engage_after_s`; released once
it has stayed below `release_ratio` (lower) for `release_after_s` (longer). Between the two ratios,
or with fewer than two replicas known, the state holds. Checked after the scrapes (about once a
second), never per request. Pure: no clock, no I/O.
"""

from __future__ import annotations

import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from picker.scheduling.latency import LatencyModel, tpot_features, ttft_features

MEASURED = 3.0  # a replica's own observations (decayed weight) before it counts, on each figure
_PROBE_PREFILL = 1000.0  # prefill tokens of the typical request compared, before any observation
_PROBE_RUNNING = 4.0  # requests running beside it, before any observation


@dataclass(frozen=True, slots=True)
class Speed:
    """One replica's predicted times for the pool's typical request."""

    first_s: float  # to the first token, once in a batch slot
    token_s: float  # per output token
    wait_s: float = 0.0  # for a batch slot, at the pool's typical load


def speeds(model: LatencyModel, slots: Mapping[str, float] | None = None) -> dict[str, Speed]:
    """The speed of every replica measured lately. `slots`: each replica's batch slots (counted only
    when every measured replica's are known)."""
    pool = model.pool
    running = pool.tpot.mean(1, _PROBE_RUNNING)
    ttft_x = ttft_features(pool.ttft.mean(1, _PROBE_PREFILL / 1000.0) * 1000.0, 0.0)
    tpot_x = tpot_features(running)
    tokens = model.output_tokens
    out = {}
    measured = [
        address
        for address, replica in model.replicas.items()
        if replica.ttft.weight >= MEASURED and replica.tpot.weight >= MEASURED
    ]
    # a slot wait only where every measured replica's slots are known: slots learned on some
    # replicas (from a scrape that showed a queue) and not yet on others are no difference
    known = slots if slots and all(slots.get(address) for address in measured) else {}
    for address in measured:
        token_s = model.tpot(address, tpot_x)
        held = known.get(address, 0.0)
        wait_s = 0.0
        if held > 0 and running + 1.0 > held:  # the typical request waits for a slot there
            wait_s = (running + 1.0 - held) * token_s * tokens / held
        out[address] = Speed(model.ttft(address, ttft_x), token_s, wait_s)
    return out


def spread_of(known: Mapping[str, Speed], tokens: float) -> float | None:
    """The largest gap between a slower and a quicker group of replicas (see the module's
    docstring); None with fewer than two known."""
    if len(known) < 2:
        return None
    ranked = sorted(known.values(), key=lambda s: s.first_s + s.wait_s + s.token_s * tokens)
    widest = 1.0
    for split in range(1, len(ranked)):
        quick, slow = ranked[:split], ranked[split:]
        first_q, token_q = _median(s.first_s for s in quick), _median(s.token_s for s in quick)
        first_s, token_s = _median(s.first_s for s in slow), _median(s.token_s for s in slow)
        wait_q, wait_s = _median(s.wait_s for s in quick), _median(s.wait_s for s in slow)
        decode = token_s / token_q if token_q > 0 else 1.0
        first = min(first_s, first_q * max(1.0, decode))  # slower only as far as the decode is
        quicker = first_q + wait_q + token_q * tokens
        if quicker > 0:
            widest = max(widest, (first + wait_s + token_s * tokens) / quicker)
    return widest


def spread(model: LatencyModel, slots: Mapping[str, float] | None = None) -> float | None:
    """The spread of the replicas measured lately (none held)."""
    return spread_of(speeds(model, slots), model.output_tokens)


def _median(values: Sequence[float] | object) -> float:
    return statistics.median(list(values))  # type: ignore[call-overload]


@dataclass(slots=True)
class Uniformity:
    """The `auto` switch with hysteresis: `judge` after the model changed; `engaged` is the state."""

    engage_ratio: float  # the settings (affinity.latency_*; their defaults: config/model.py)
    release_ratio: float
    engage_after_s: float
    release_after_s: float
    engaged: bool = False
    last_spread: float | None = None
    _contrary_since: float | None = None  # since when the spread says the other state
    # every replica's last measured speed: one that goes unmeasured keeps it until it leaves
    held: dict[str, Speed] = field(default_factory=dict)

    def judge(
        self,
        model: LatencyModel,
        now: float,
        slots: Mapping[str, float] | None = None,
        ready: Collection[str] | None = None,
    ) -> bool:
        """Measure the replicas, keep what each was last measured at, take one reading; True when
        the state switched. `ready`: the replicas that may take work (None: all); one that drains or
        is not ready is not judged, and its held speed goes (it could never be measured again)."""
        known = {
            address: speed
            for address, speed in (*self.held.items(), *speeds(model, slots).items())
            if address in model.replicas and (ready is None or address in ready)
        }
        self.held = known
        return self.check(spread_of(known, model.output_tokens), now)

    def check(self, spread: float | None, now: float) -> bool:
        """Take one reading; True when the state switched."""
        self.last_spread = spread
        if spread is None:
            contrary = False  # nothing measured: hold
        elif self.engaged:
            contrary = spread < self.release_ratio
        else:
            contrary = spread >= self.engage_ratio
        if not contrary:
            self._contrary_since = None
            return False
        if self._contrary_since is None:
            self._contrary_since = now
        if now - self._contrary_since < (self.release_after_s if self.engaged else self.engage_after_s):
            return False
        self.engaged = not self.engaged
        self._contrary_since = None
        return True
