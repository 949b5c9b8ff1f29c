"""Each replica's speed, learned online from what the picker sees: a latency model per endpoint.

A pool in a rollout is not uniform (another engine version, another GPU, a cold cache, another batch
limit), and a replica twice as slow that gets the same share of new work builds a queue and sets the
pool's tail. The picker already sees every request's time to first token, its chunk gaps, its
uncached prompt tokens and each replica's queue, so it learns, per replica:

- **TTFT** = a + b x (prefill tokens ahead, in thousands: the replica's backlog of uncached prompt
  tokens not started, plus this request's own) + c x (the wait for a batch slot: the requests queued
  on the engine ahead of it x the replica's predicted time to serve one / its slots; c is about 1);
- **time per output token** = d + e x (requests running there).

Each is a linear fit over decayed sums (every observation's weight halves every `half_life_s`), so a
replica that changes (a new version, a noisy neighbour) is re-learned within seconds, and one that
gets no traffic slides back to the pool's figures, which it then gets traffic to check. The fit is
pulled toward the pool's own fit (a ridge prior): a cold replica starts from the pool's figures and
leaves them as its own observations weigh more. Residuals are clipped at a few times their running
mean size, so one outlier (a stall, a preempted request) moves nothing much. Pure code: no clock, no
I/O; a fit costs a few microseconds, a prediction well under one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

TTFT_FEATURES = 3  # 1, prefill kilo-tokens ahead, seconds of slot wait ahead (estimated)
TPOT_FEATURES = 2  # 1, requests running
_CLIP = 4.0  # residuals beyond this many times their running mean size are clipped
_PRIOR_WEIGHT = 5.0  # the pool's figures weigh as much as this many observations
_MEMORY = 30.0  # ... and a replica's own, at most as much as its last this many (older ones fade)
_FLOOR_S = 0.0005  # no prediction below half a millisecond


@dataclass(slots=True)
class DecayedFit:
    """A least-squares fit y ~ theta . x over observations whose weights decay with age.

    The sums are kept as `scale` x the stored ones: ageing them, or capping their weight at the
    memory, multiplies `scale` alone (one multiplication, where scaling every sum was a dozen per
    observation, four observations a request), and an observation is added divided by it."""

    size: int
    half_life_s: float
    xx: list[list[float]] = field(default_factory=list)  # stored: the sums are these x scale
    xy: list[float] = field(default_factory=list)
    stored_weight: float = 0.0
    scale: float = 1.0
    abs_residual: float = 0.0  # the running mean size of a residual (for clipping)
    at: float | None = None

    def __post_init__(self) -> None:
        self.xx = [[0.0] * self.size for _ in range(self.size)]
        self.xy = [0.0] * self.size

    @property
    def weight(self) -> float:
        """The observations' total weight now (about how many recent ones)."""
        return self.stored_weight * self.scale

    def decay_to(self, now: float) -> None:
        at = self.at
        if at is not None and now > at:
            self.scale *= 0.5 ** ((now - at) / self.half_life_s)
            if self.scale < 1e-9:  # keep the stored sums in range: fold the scale into them
                self._fold()
        self.at = now if at is None or now > at else at

    def observe(self, x: Sequence[float], y: float, now: float, predicted: float | None) -> None:
        """One observation; `predicted` (what the fit said before it) clips an outlier's pull."""
        self.decay_to(now)
        if predicted is not None:
            residual = y - predicted
            bound = _CLIP * self.abs_residual
            weight = self.weight
            if weight >= 1.0 and bound > 0 and abs(residual) > bound:
                residual = math.copysign(bound, residual)  # an outlier pulls no harder than this
                y = predicted + residual
            if weight >= 1.0:
                self.abs_residual += 0.1 * (abs(residual) - self.abs_residual)
            else:
                self.abs_residual = abs(residual)
        inverse = 1.0 / self.scale
        size = self.size
        for i in range(size):
            xi = x[i] * inverse
            row = self.xx[i]
            for j in range(size):
                row[j] += xi * x[j]
            self.xy[i] += xi * y
        self.stored_weight += inverse
        weight = self.stored_weight * self.scale
        if weight > _MEMORY:  # a busy replica's fit follows its last observations, not its first
            self.scale *= _MEMORY / weight
            if self.scale < 1e-9:  # observations at one instant cap it without ageing: fold here too
                self._fold()

    def _fold(self) -> None:
        factor, size = self.scale, self.size
        for row in self.xx:
            for j in range(size):
                row[j] *= factor
        for j in range(size):
            self.xy[j] *= factor
        self.stored_weight *= factor
        self.scale = 1.0

    def mean(self, i: int, default: float) -> float:
        """Feature `i`'s mean over the observations, weighted as the fit weighs them (the first
        feature is the constant 1); `default` with none."""
        total = self.xx[0][0]
        return self.xx[0][i] / total if total * self.scale > 1e-9 else default

    def solve(self, prior: Sequence[float], now: float) -> tuple[float, ...]:
        """The fit, pulled toward `prior` (ridge): `prior` itself with no recent observation."""
        self.decay_to(now)
        size, factor, ridge = self.size, self.scale, _PRIOR_WEIGHT
        a = [[self.xx[i][j] * factor + (ridge if i == j else 0.0) for j in range(size)] for i in range(size)]
        b = [self.xy[i] * factor + ridge * prior[i] for i in range(size)]
        solved = _gauss(a, b)
        return tuple(prior) if solved is None else solved


def _gauss(a: list[list[float]], b: list[float]) -> tuple[float, ...] | None:
    """Solve a x = b (small, symmetric positive definite with the ridge); None if singular."""
    n = len(b)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-12:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for c in range(col, n):
                    a[r][c] -= f * a[col][c]
                b[r] -= f * b[col]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (b[r] - sum(a[r][c] * x[c] for c in range(r + 1, n))) / a[r][r]
    return tuple(x)


@dataclass(slots=True)
class Error:
    """Mean absolute percentage error of the predictions, over about the last 20 that were checked."""

    value: float | None = None
    checked: int = 0

    def add(self, predicted: float, measured: float) -> None:
        if measured <= 0:
            return
        error = abs(predicted - measured) / measured
        self.checked += 1
        self.value = error if self.value is None else self.value + 0.05 * (error - self.value)


@dataclass(slots=True)
class ReplicaLatency:
    """One replica's fits (or the pool's), and how well they predicted."""

    ttft: DecayedFit
    tpot: DecayedFit
    ttft_params: tuple[float, ...] = ()
    tpot_params: tuple[float, ...] = ()
    ttft_error: Error = field(default_factory=Error)
    tpot_error: Error = field(default_factory=Error)
    last_at: float | None = None

    @classmethod
    def new(cls, half_life_s: float) -> ReplicaLatency:
        return cls(DecayedFit(TTFT_FEATURES, half_life_s), DecayedFit(TPOT_FEATURES, half_life_s))


def ttft_features(prefill_tokens: float, slot_wait_s: float) -> tuple[float, float, float]:
    return (1.0, max(0.0, prefill_tokens) / 1000.0, max(0.0, slot_wait_s))


def tpot_features(running: float) -> tuple[float, float]:
    return (1.0, max(0.0, running))


def _dot(params: Sequence[float], x: Sequence[float]) -> float:
    total = 0.0
    for i in range(len(x)):  # two or three terms, every pick: a plain loop is the quickest here
        total += params[i] * x[i]
    return total if total > _FLOOR_S else _FLOOR_S


# A pool with no observation yet: 50 ms to a first token, 0.1 s per 1,000 prefill tokens ahead,
# the slot wait as estimated, 20 ms per token. Replaced by the pool's own figures at once.
STARTING_TTFT = (0.05, 0.1, 1.0)
STARTING_TPOT = (0.02, 0.0)


class LatencyModel:
    """Every replica's learned latency, and the pool's (what a cold replica starts from)."""

    def __init__(self, half_life_s: float = 5.0) -> None:
        self.half_life_s = half_life_s
        self.pool = ReplicaLatency.new(half_life_s)
        self.pool.ttft_params, self.pool.tpot_params = STARTING_TTFT, STARTING_TPOT
        self.replicas: dict[str, ReplicaLatency] = {}
        self.output_tokens = 64.0  # tokens a stream produces, on average lately (the slot wait's unit)
        # fit at every observation (the pick routes by the predictions); False (auto, not engaged):
        # observations only add up, unclipped (the fit they would be clipped by may be a second
        # old), and `refresh` (at most once a second) fits them: two Gaussian eliminations a request
        # would be most of a learning's cost
        self.eager = True

    def predict(
        self, address: str, prefill_tokens: float, queued_ahead: float, slots: float, running: float
    ) -> tuple[float, float, tuple[float, float, float], tuple[float, float]]:
        """(TTFT, TPOT) predicted for one request on one replica, and the features they came from.
        The slot wait ahead is estimated from the replica's own speed (its predicted time per token
        x the tokens a stream produces, per slot): a replica with half the slots, or twice as slow,
        makes a request wait twice as long per request queued ahead. Every pick calls this for every
        candidate: the time per token is computed once and serves both."""
        replica = self.replicas.get(address) or self.pool
        tpot_x = tpot_features(running)
        tpot = _dot(replica.tpot_params, tpot_x)
        ttft_x = ttft_features(prefill_tokens, queued_ahead * tpot * self.output_tokens / max(1.0, slots))
        return _dot(replica.ttft_params, ttft_x), tpot, ttft_x, tpot_x

    def slowdown(self, address: str, running: float, tokens: float) -> float:
        """Seconds the `running` streams on `address` lose together to one more request decoding
        beside them for `tokens` tokens: the time per token grows by e per request running."""
        replica = self.replicas.get(address) or self.pool
        return max(0.0, replica.tpot_params[1]) * running * tokens

    def _replica(self, address: str) -> ReplicaLatency:
        found = self.replicas.get(address)
        if found is None:
            found = self.replicas[address] = ReplicaLatency.new(self.half_life_s)
            found.ttft_params, found.tpot_params = self.pool.ttft_params, self.pool.tpot_params
        return found

    def ttft(self, address: str, x: Sequence[float]) -> float:
        """Predicted seconds to the first token on `address` for a request with features `x`."""
        replica = self.replicas.get(address)
        return _dot(replica.ttft_params if replica is not None else self.pool.ttft_params, x)

    def tpot(self, address: str, x: Sequence[float]) -> float:
        replica = self.replicas.get(address)
        return _dot(replica.tpot_params if replica is not None else self.pool.tpot_params, x)

    def learn_ttft(self, address: str, x: Sequence[float], seconds: float, now: float) -> None:
        """A first token came `seconds` after its pick, on `address`."""
        if not (0.0 <= seconds < 3600.0):
            return
        replica = self._replica(address)
        predicted = _dot(replica.ttft_params, x)
        if replica.ttft.weight >= _PRIOR_WEIGHT:  # past its start from the pool's figures
            replica.ttft_error.add(predicted, seconds)
        replica.ttft.observe(x, seconds, now, predicted if self.eager else None)
        self.pool.ttft.observe(x, seconds, now, _dot(self.pool.ttft_params, x) if self.eager else None)
        if self.eager:
            self.pool.ttft_params = self.pool.ttft.solve(STARTING_TTFT, now)
            replica.ttft_params = replica.ttft.solve(self.pool.ttft_params, now)
        replica.last_at = now

    def learn_tpot(
        self, address: str, x: Sequence[float], seconds: float, now: float, tokens: int = 0
    ) -> None:
        """A stream of `tokens` ended; its chunks came `seconds` per output token after the first."""
        if not (0.0 <= seconds < 60.0):
            return
        if tokens > 0:
            self.output_tokens += 0.05 * (min(tokens, 4096) - self.output_tokens)
        replica = self._replica(address)
        predicted = _dot(replica.tpot_params, x)
        if replica.tpot.weight >= _PRIOR_WEIGHT:
            replica.tpot_error.add(predicted, seconds)
        replica.tpot.observe(x, seconds, now, predicted if self.eager else None)
        self.pool.tpot.observe(x, seconds, now, _dot(self.pool.tpot_params, x) if self.eager else None)
        if self.eager:
            self.pool.tpot_params = self.pool.tpot.solve(STARTING_TPOT, now)
            replica.tpot_params = replica.tpot.solve(self.pool.tpot_params, now)
        replica.last_at = now

    def refresh(self, now: float) -> None:
        """Let every replica's old observations fade toward the pool's figures (a replica that gets
        no traffic is not judged for ever by what it once did). Cheap; called every few seconds."""
        self.pool.ttft_params = self.pool.ttft.solve(STARTING_TTFT, now)
        self.pool.tpot_params = self.pool.tpot.solve(STARTING_TPOT, now)
        for replica in self.replicas.values():
            replica.ttft_params = replica.ttft.solve(self.pool.ttft_params, now)
            replica.tpot_params = replica.tpot.solve(self.pool.tpot_params, now)

    def forget(self, address: str) -> None:
        self.replicas.pop(address, None)

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per replica: its learned figures and its prediction error (for metrics and the admin API)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for address, replica in sorted(self.replicas.items()):
            a, b, c = replica.ttft_params
            d, e = replica.tpot_params
            out[address] = {
                "ttft_base_s": round(a, 4),
                "prefill_s_per_ktoken": round(b, 4),
                "queue_s_per_request": round(c, 4),
                "tpot_base_s": round(d, 5),
                "tpot_s_per_running": round(e, 6),
                "ttft_mape": None if replica.ttft_error.value is None else round(replica.ttft_error.value, 3),
                "tpot_mape": None if replica.tpot_error.value is None else round(replica.tpot_error.value, 3),
                "weight": round(replica.ttft.weight, 1),
            }
        return out
