"""What deleting each pod of the pool would cost, from the work the picker sees on it.

When an autoscaler lowers a Deployment's replicas, the ReplicaSet controller deletes the pods whose
`controller.kubernetes.io/pod-deletion-cost` annotation is lowest (after the ones not yet ready). The
picker knows what a deletion would disturb: each replica's streams, how far along each is, and the
cache it holds. A pod's deletion costs about as long as its drain would last, so:

- each stream's **time left** = (tokens asked - tokens sent) x the replica's time per token. Tokens
  asked is the request's max_tokens; where that is unknown the stream is expected to send
  `unknown_tokens` in all, and once past that as many more as it has sent (a long generation tends
  to run on). A stream still waiting for its first token (queued on the engine, or in prefill)
  counts whole. The replica's time per token is measured from its own streams (time since their
  first token over tokens sent), else the pool's, else `time_per_token_s`;
- another picker's requests on it (peers' books: counts only) count as streams of unknown length;
- the pod's **cost** = its longest time left (its drain time: the wait, and what the grace period
  would cut) + `work_weight` x the sum of its times left (fewer streams disturbed among equal
  drains) + `cache_s` x its share of the largest cache in the pool (blocks it is known to hold).

Pure: plain values in, plain values out; no clock, no I/O. `picker/pool/deletion_rank.py` turns
the costs into annotation values with hysteresis; picker/sources/deletion_cost.py writes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from picker.pool.endpoint import Endpoint, EndpointState

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
INT32 = (-(2**31), 2**31 - 1)  # what the API server accepts as the annotation's value


@dataclass(frozen=True, slots=True)
class Stream:
    """One request in flight on an endpoint, as far as its remaining time goes."""

    endpoint: str
    asked: int | None  # max_tokens (None: the engine's default, unknown here)
    sent: int  # tokens sent so far
    first_token_at: float | None  # None: no token yet (queued on the engine, or in prefill)


@dataclass(frozen=True, slots=True)
class PodRef:
    """One pool pod as its source lists it: where its endpoints are and what its annotation says."""

    namespace: str
    name: str
    addresses: tuple[str, ...]  # its endpoints (pod IP x each target port)
    uid: str | None = None
    value: int | None = None  # its pod-deletion-cost annotation now (None: none, or not an int32)
    deleting: bool = False  # deletionTimestamp set: already going, nothing to rank

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class CostPolicy:
    """The figures a cost is made of (their defaults: `scale_down` in picker/config/model.py)."""

    unknown_tokens: int  # tokens a stream without max_tokens is expected to send in all
    time_per_token_s: float  # where neither the replica nor the pool has a stream to measure it by
    work_weight: float  # weight of the summed time left beside the longest
    cache_s: float  # what the largest cache in the pool is worth, in seconds of drain


@dataclass(frozen=True, slots=True)
class PodWork:
    """What deleting one pod would disturb, and its cost (seconds)."""

    pod: str  # namespace/name
    streams: int
    waiting: int  # of them, those without a first token yet
    longest_s: float
    total_s: float
    cache_share: float  # 0-1: its blocks over the pool's largest
    cost: float


def read_value(text: object) -> int | None:
    """The annotation's value as the API server validates it (a decimal int32); None otherwise."""
    if not isinstance(text, str) or not text.strip().lstrip("+-").isdigit():
        return None
    value = int(text.strip())
    return value if INT32[0] <= value <= INT32[1] else None


def tokens_left(stream: Stream, unknown_tokens: int) -> int:
    if stream.asked is not None:
        return max(0, stream.asked - stream.sent)
    return max(unknown_tokens - stream.sent, stream.sent)


def times_per_token(streams: Iterable[Stream], now: float) -> tuple[dict[str, float], float | None]:
    """Each endpoint's time per token measured from its streams, and the pool's (None: no stream
    has sent two tokens yet). Time since the first token over the tokens after it, summed."""
    elapsed: dict[str, float] = {}
    tokens: dict[str, int] = {}
    for stream in streams:
        if stream.first_token_at is None or stream.sent < 2 or now <= stream.first_token_at:
            continue
        elapsed[stream.endpoint] = elapsed.get(stream.endpoint, 0.0) + now - stream.first_token_at
        tokens[stream.endpoint] = tokens.get(stream.endpoint, 0) + stream.sent - 1
    per = {address: elapsed[address] / tokens[address] for address in elapsed}
    total = sum(tokens.values())
    return per, (sum(elapsed.values()) / total if total else None)


def _held(endpoint: Endpoint | None) -> int:
    """Cache blocks the endpoint is known to hold: the engine's word (KV events), else the index."""
    if endpoint is None:
        return 0
    if endpoint.kv is not None:
        return len(endpoint.kv)
    return len(endpoint.prefix) if endpoint.prefix is not None else 0


def pod_work(
    pods: Sequence[PodRef],
    streams: Iterable[Stream],
    endpoints: Mapping[str, Endpoint],
    policy: CostPolicy,
    now: float,
) -> dict[str, PodWork]:
    """Each pod's work and cost, by `namespace/name` (pods being deleted are left out)."""
    streams = list(streams)
    per_endpoint, pool_tpt = times_per_token(streams, now)
    default_tpt = pool_tpt if pool_tpt is not None else policy.time_per_token_s
    by_endpoint: dict[str, list[Stream]] = {}
    for stream in streams:
        by_endpoint.setdefault(stream.endpoint, []).append(stream)
    held = {pod.key: sum(_held(endpoints.get(a)) for a in pod.addresses) for pod in pods}
    largest = max(held.values(), default=0)
    out: dict[str, PodWork] = {}
    for pod in pods:
        if pod.deleting:
            continue
        lefts: list[float] = []
        waiting = 0
        for address in pod.addresses:
            tpt = per_endpoint.get(address, default_tpt)
            for stream in by_endpoint.get(address, ()):
                lefts.append(tokens_left(stream, policy.unknown_tokens) * tpt)
                waiting += stream.first_token_at is None
            endpoint = endpoints.get(address)
            if endpoint is not None and endpoint.state is not EndpointState.GONE:
                lefts += [policy.unknown_tokens * tpt] * endpoint.peer_in_flight
        longest, total = max(lefts, default=0.0), sum(lefts)
        share = held[pod.key] / largest if largest else 0.0
        cost = longest + policy.work_weight * total + policy.cache_s * share
        out[pod.key] = PodWork(pod.key, len(lefts), waiting, longest, total, share, cost)
    return out
