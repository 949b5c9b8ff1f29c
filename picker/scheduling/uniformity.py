"""Whether the pool is uniform: the switch of `affinity.latency: auto`.

The latency model (picker/scheduling/latency.py) learns every replica's speed whatever the setting;
routing by its predictions helps only a pool whose replicas differ (another GPU, another version, a
noisy neighbour) and costs a uniform pool prefix hits and a few microseconds a pick. So under
`auto` the pick uses the predictions only while the pool measurably is not uniform:

- the **spread** is the slowest measured replica's predicted time for the same request (the pool's
  typical one: the prefill tokens and the requests running beside it that the pool was measured at
  lately, the tokens a stream produces lately) over the median replica's (the quicker's, with
  two: on bench_affinity's uniform pool of four, the slowest over the quickest swung between 1.1
  and 1.7); a replica counts once it has observations of its own on both figures (one that got no
  traffic lately has none: it tells nothing either way). Compared where the pool runs, not at a
  fixed load: a fit is right where it was measured, and a pool near its capacity is measured only
  there (13-16 running on bench_shapes: compared at four, a replica twice as slow looked 1.24x);
- engaged once the spread has stayed at or above `engage_ratio` for `engage_after_s`; released once
  it has stayed below `release_ratio` (lower) for `release_after_s` (longer: a pool that is not
  uniform costs more while the switch is off than a uniform one while it is on). Between the two
  ratios, or with fewer than two measured replicas, the state holds: a slow replica the pick stopped
  sending work to does not switch it off by going unmeasured.
Checked after the scrapes (about once a second), never per request. Pure: no clock, no I/O.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from picker.scheduling.latency import LatencyModel, tpot_features, ttft_features

MEASURED = 3.0  # a replica's own observations (decayed weight) before it counts, on each figure
_PROBE_PREFILL = 1000.0  # prefill tokens of the typical request compared, before any observation
_PROBE_RUNNING = 4.0  # requests running beside it, before any observation


def spread(model: LatencyModel) -> float | None:
    """The slowest measured replica's predicted time for the typical request over the median
    replica's (the quicker's, with two); None with fewer than two measured."""
    pool = model.pool
    # no slot wait: the replicas' speed is compared, not their queues (the pick counts those)
    ttft_x = ttft_features(pool.ttft.mean(1, _PROBE_PREFILL / 1000.0) * 1000.0, 0.0)
    tpot_x = tpot_features(pool.tpot.mean(1, _PROBE_RUNNING))
    tokens = model.output_tokens
    times = [
        model.ttft(address, ttft_x) + model.tpot(address, tpot_x) * tokens
        for address, replica in model.replicas.items()
        if replica.ttft.weight >= MEASURED and replica.tpot.weight >= MEASURED
    ]
    if len(times) < 2:
        return None
    # against the median replica (the quicker of two): one replica's noisy fit (a prefill queue, a
    # time per token learned from a few short streams) must not make a uniform pool look uneven
    return max(times) / (min(times) if len(times) == 2 else statistics.median(times))


@dataclass(slots=True)
class Uniformity:
    """The `auto` switch with hysteresis: `check` after the model changed; `engaged` is the state."""

    engage_ratio: float  # the settings (affinity.latency_*; their defaults: config/model.py)
    release_ratio: float
    engage_after_s: float
    release_after_s: float
    engaged: bool = False
    last_spread: float | None = None
    _contrary_since: float | None = None  # since when the spread says the other state

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
