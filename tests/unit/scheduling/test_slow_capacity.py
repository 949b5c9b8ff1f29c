"""Slow capacity still used (issue 54, item 2): a request's cost on a replica counts the time the streams
decoding there lose to it, so a slower replica with room takes work once the quick ones are loaded
(what it can serve), and none while they are not."""

from __future__ import annotations

import random

from picker.config.model import AffinityConfig
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.placement import Placement
from picker.scheduling import LoadPolicy
from picker.scheduling.latency import ReplicaLatency
from picker.streams import RequestRecord

QUICK, SLOW = ("10.0.0.1:8000", "10.0.0.2:8000"), "10.0.0.3:8000"


def placement_with(running_on_quick: int) -> tuple[Placement, Pool]:
    pool = Pool()
    pool.apply(ready=[*QUICK, SLOW])
    placement = Placement(pool, AffinityConfig(prefix="off", latency="on"), Metrics(pool="default"), None)
    model = placement.latency
    assert model is not None
    for address, speed in ((QUICK[0], 1.0), (QUICK[1], 1.0), (SLOW, 2.0)):
        replica = model.replicas[address] = ReplicaLatency.new(5.0)
        # TTFT 20 ms + 50 ms per 1k prefill tokens; 15 ms a token + 1.5 ms per request running (x speed)
        replica.ttft_params = (0.02 * speed, 0.05 * speed, 1.0)
        replica.tpot_params = (0.015 * speed, 0.0015 * speed)
    for endpoint in pool.endpoints():
        busy = running_on_quick if endpoint.address in QUICK else 0
        for _ in range(busy):
            pool.lease(endpoint.address)
        record_sample(endpoint, running=busy, waiting=0, kv_usage=0.1, now=0.0)  # no queue: slots unknown
    return placement, pool


def primary(running_on_quick: int) -> str:
    placement, pool = placement_with(running_on_quick)
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True, max_tokens=32)
    record = RequestRecord(request_id="r", admitted_at=0.0, max_tokens=32)
    record.keys = placement.keys(request, None, None)
    choice = placement.choose(record, pool.ready(), 1, random.Random(1), 0.0, LoadPolicy(), frozenset())
    assert choice is not None and choice.destinations
    return choice.destinations[0]


def test_the_slow_replica_idles_while_the_quick_ones_have_light_load() -> None:
    assert primary(2) in QUICK


def test_the_slow_replica_takes_work_once_the_quick_ones_are_loaded() -> None:
    """Ten streams on each quick replica: one more finishes there a little sooner than on the idle slow
    one (1.03 s against 1.1 s) but costs the ten streams beside it 0.48 s between them."""
    assert primary(10) == SLOW
