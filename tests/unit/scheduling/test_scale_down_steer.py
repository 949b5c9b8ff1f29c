"""Keeping long requests off the pods a scale-down takes next (issue 55, kube.deletion_cost): the
scorer alone, the request's steer, and picks through the placement with and without ranks."""

from __future__ import annotations

import random

from picker.config.model import AffinityConfig
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.deletion_rank import ScaleDownRanks
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.placement import Placement
from picker.scheduling import LoadPolicy, scorers
from picker.scheduling.rows import DEFAULT_OUTPUT_TOKENS, Row, steer
from picker.scheduling.scorers import Spans
from picker.streams import RequestRecord

A, B, C, D = (f"10.0.0.{n}:8000" for n in range(1, 5))
# D's pod goes last, A's first
RANKS = ScaleDownRanks({A: 0.0, B: 1 / 3, C: 2 / 3, D: 1.0}, steer_tokens=100)


def test_the_scorer_reads_the_row_within_the_load_gap_only() -> None:
    near = Row(A, False, False, False, 0.0, 0.0, 2.0, stays=0.75)
    far = Row(B, False, False, False, 0.0, 0.0, 9.0, stays=1.0)
    spans = Spans.of([near, far], [near], False, load_limit=4.0)
    assert scorers.scale_down(near, spans) == 0.75
    assert scorers.scale_down(far, spans) == 0.0  # past the gap the load decides


def test_a_request_steers_by_what_it_asks_against_the_pools_long() -> None:
    assert steer(50, 100) == 0.5
    assert steer(5000, 100) == 1.0  # uncapped below: a long max_tokens is what makes a drain long
    assert steer(None, 1000) == DEFAULT_OUTPUT_TOKENS / 1000  # none set: the engine's usual


def _placement(loads: dict[str, int], ranks: ScaleDownRanks | None) -> tuple[Pool, Placement]:
    pool = Pool()
    pool.apply(ready=list(loads))
    for address, running in loads.items():
        endpoint = pool.get(address)
        assert endpoint is not None
        record_sample(endpoint, running, 0, 0.1, 0.0)
    pool.scale_down = ranks
    return pool, Placement(pool, AffinityConfig(latency="off"), Metrics(pool="default"), None)


def _primary(pool: Pool, placement: Placement, max_tokens: int | None, seed: int) -> str | None:
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True, prompt=b"x")
    record = RequestRecord(
        request_id=str(seed), admitted_at=0.0, keys=placement.keys(request, None, None), max_tokens=max_tokens
    )
    policy = LoadPolicy()
    choice = placement.choose(record, pool.ready(), 2, random.Random(seed), 0.1, policy, frozenset())
    return choice.destinations[0] if choice is not None and choice.destinations else None


def test_a_long_request_goes_to_the_pods_a_scale_down_takes_last_within_the_load_gap() -> None:
    even, placement = _placement({A: 1, B: 1, C: 1, D: 1}, RANKS)
    assert {_primary(even, placement, 400, seed) for seed in range(20)} == {D}
    # the steer weighs as much as the load (2): one request more is worth a third of the ranks
    pool, placement = _placement({A: 0, B: 1, C: 1, D: 2}, RANKS)
    assert {_primary(pool, placement, 400, seed) for seed in range(20)} == {C}
    # without ranks the same picks follow the load: A, the least loaded
    pool.scale_down = None
    assert {_primary(pool, placement, 400, seed) for seed in range(20)} == {A}


def test_a_short_request_still_follows_the_load() -> None:
    pool, placement = _placement({A: 0, B: 1, C: 1, D: 2}, RANKS)
    assert {_primary(pool, placement, 5, seed) for seed in range(20)} == {A}


def test_past_the_load_gap_the_first_to_go_takes_the_work_rather_than_idle() -> None:
    pool, placement = _placement({A: 0, B: 6, C: 6, D: 6}, RANKS)  # the gap: 4 requests
    assert {_primary(pool, placement, 400, seed) for seed in range(20)} == {A}
