"""A clairvoyant dispatcher for the routing proving ground: what a router that knew everything would reach.

The proving ground's `floor` (loadtest/bench_routing.py) is each request alone on an idle replica: no
policy goes below it, but at 70 % of a pool's capacity no policy reaches it either, for requests meet
each other in the queues. This module replays a row's own requests through the simulator's model of a
pool (sim/vllm_sim: FCFS batch slots, a first token at the slot's start plus the fixed part and the
prefill of the uncached prompt tokens, each duration stretched by the replica's slowdown, a prefix
cache of whole blocks) and sends each, on arrival, to the replica where its first token comes
soonest, knowing every request's exact length, every slot's free time and every cache's content.
Ties go to the replica that finishes it first.

It is a reference, not a bound: choosing the soonest first token for each request alone is greedy (a
miss taken now can evict a prefix a later request needed), and it leaves out the gateway's path (the
measured columns pay a few milliseconds of it). Where the picker's TTFT p90 is near it, the room left
on that row is not the pick's. Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Replica:
    slots: int
    slowdown: float = 1.0
    # slower than `slowdown` by this factor for requests arriving before `warm_until_s` (a restart)
    warm_factor: float = 1.0
    warm_until_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Request:
    at_s: float  # arrival, from the start of the run
    tokens: int  # prompt tokens
    out_tokens: int
    group: int | None = None  # its shared prefix, if any
    held_tokens: int = 0  # prompt tokens a replica holding the group has cached


@dataclass(frozen=True, slots=True)
class Model:
    """The base replica's latency model (the simulator's arguments), in milliseconds."""

    ttft_ms: float
    prefill_ms_per_token: float
    itl_ms: float
    cached_groups: int = 0  # shared prefixes each replica's cache holds (least recently used goes)


def dispatch(replicas: Sequence[Replica], requests: Sequence[Request], model: Model) -> list[float]:
    """Each request's time to first token (ms), in the order given (which must be by arrival)."""
    free = [[0.0] * r.slots for r in replicas]  # per replica: a heap of its slots' free times (s)
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in replicas]
    last = float("-inf")
    out = []
    for request in requests:
        if request.at_s < last:
            raise ValueError("requests must come in order of arrival")
        last = request.at_s
        best: tuple[float, float, int] | None = None
        for index, replica in enumerate(replicas):
            first, done = _times(replica, free[index][0], caches[index], request, model)
            if best is None or (first, done) < best[:2]:
                best = (first, done, index)
        assert best is not None
        first, done, index = best
        heapq.heapreplace(free[index], done)
        if request.group is not None and model.cached_groups:
            cache = caches[index]
            cache[request.group] = None
            cache.move_to_end(request.group)
            while len(cache) > model.cached_groups:
                cache.popitem(last=False)
        out.append((first - request.at_s) * 1000.0)
    return out


def _times(
    replica: Replica, slot_free_s: float, cache: OrderedDict[int, None], request: Request, model: Model
) -> tuple[float, float]:
    """(first token, slot free again), in seconds from the start, were the request sent there."""
    factor = replica.slowdown * (replica.warm_factor if request.at_s < replica.warm_until_s else 1.0)
    start = max(request.at_s, slot_free_s)
    hit = request.group is not None and request.group in cache
    uncached = request.tokens - (request.held_tokens if hit else 0)
    first = start + factor * (model.ttft_ms + model.prefill_ms_per_token * uncached) / 1000.0
    done = first + factor * model.itl_ms * max(0, request.out_tokens - 1) / 1000.0
    return first, done
