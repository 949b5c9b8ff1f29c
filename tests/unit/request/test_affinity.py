"""Cache-aware routing in the core (issue 22): block keys, the sticky-until-saturated pick, never into a
drain, re-homing, sessions, LoRA, GONE endpoints forgetting what they held, and the engine's feedback."""

from __future__ import annotations

import random

import pytest

from picker.config.model import AffinityConfig
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.pool.cache import PrefixIndex
from picker.pool.scrapes import record_engine_info
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.scheduling.affinity import Affinity, AffinityPolicy, pick_with_affinity
from picker.scheduling.prefix import prompt_blocks, seed_of
from picker.streams import EndReason, ResponseTracker

SYSTEM = "You are a careful assistant who answers in full sentences. " * 40  # 2,400 bytes: 9 blocks
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def request(prompt: str, model: str = "m", salt: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        "POST", "/v1/completions", model=model, stream=True, prompt=prompt.encode(), cache_salt=salt
    )


def path_of(*endpoints: str, **affinity: object) -> tuple[RequestPath, Pool]:
    pool = Pool()
    pool.apply(ready=list(endpoints))
    config = AffinityConfig(**{"prefix": "approximate", **affinity})  # type: ignore[arg-type]
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=1,
        schedule=lambda d, f: lambda: None,
        affinity=config,
        rng=random.Random(7),
    )
    pool.on_change(path.capacity_changed)
    return path, pool


def route(path: RequestPath, prompt: str, keep: bool = False, **options: object) -> str:
    """Route one request; it ends at once unless `keep` (then it adds to its endpoint's load)."""
    record = path.admit(request(prompt), **options).payload  # type: ignore[arg-type]
    assert record.picked, "dispatched"
    if not keep:
        path.finish(record, EndReason.CLIENT_DISCONNECT)
    return record.picked[0]


def test_blocks_chain_the_whole_prefix_and_only_full_blocks_count() -> None:
    seed = seed_of("m")
    one = prompt_blocks((SYSTEM + "first question").encode(), 256, seed, 2048)
    two = prompt_blocks((SYSTEM + "second, different question").encode(), 256, seed, 2048)
    assert one[:9] == two[:9] and len(one) == 9  # the shared system prompt; no partial last block
    assert prompt_blocks(b"short", 256, seed, 2048) == ()
    assert prompt_blocks(SYSTEM.encode(), 256, seed_of("other"), 2048)[0] != one[0]  # another model
    assert prompt_blocks(SYSTEM.encode(), 256, seed_of("m", "tenant"), 2048)[0] != one[0]  # a salt
    assert len(prompt_blocks(SYSTEM.encode() * 10, 256, seed, 5)) == 5


def test_requests_sharing_a_prefix_stick_to_the_endpoint_that_has_it() -> None:
    path, _ = path_of(A, B, C)
    first = route(path, SYSTEM + "q0")
    assert all(route(path, SYSTEM + f"q{i}") == first for i in range(1, 20))
    groups = {route(path, f"group {g} " * 200 + "q", keep=True) for g in range(12)}
    assert len(groups) == 3  # cold prefixes spread by load


def test_a_hot_prefix_spreads_once_its_endpoint_passes_the_load_gap() -> None:
    path, pool = path_of(A, B, C, max_load_gap=2.0, load_gap_ratio=0.0)
    placed = [route(path, SYSTEM + f"q{i}", keep=True) for i in range(9)]  # none ends: load grows
    counts = {address: placed.count(address) for address in (A, B, C)}
    assert max(counts.values()) - min(counts.values()) <= 3  # at most the gap plus one apart
    assert all(pool.get(a).prefix is not None and len(pool.get(a).prefix) for a in (A, B, C))  # type: ignore[union-attr]


def test_a_draining_endpoint_is_never_picked_for_affinity_and_its_prefixes_rehome() -> None:
    path, pool = path_of(A, B, C)
    home = route(path, SYSTEM + "q0")
    pool.drain(home)
    moved = {route(path, SYSTEM + f"q{i}") for i in range(1, 6)}
    assert home not in moved and len(moved) == 1  # re-homed by the same rule, onto one endpoint
    assert pool.get(home).drain.picks_after_start == 0  # type: ignore[union-attr]


def test_a_gone_endpoint_forgets_what_it_held() -> None:
    path, pool = path_of(A, B)
    home = route(path, SYSTEM + "q0")
    other = B if home == A else A
    record = path.admit(request(SYSTEM + "q1")).payload
    pool.apply(ready=[other])  # removed with a request still on it: GONE
    assert pool.get(home).state is EndpointState.GONE and pool.get(home).prefix is None  # type: ignore[union-attr]
    path.finish(record, EndReason.COMPLETED)


def test_a_session_stays_on_its_endpoint_until_it_drains() -> None:
    path, pool = path_of(A, B, C, session_header="x-session-id", prefix="off")
    home = route(path, "hello", session="conversation-1")
    assert all(route(path, f"turn {i}", session="conversation-1") == home for i in range(4))
    pool.drain(home)
    moved = route(path, "turn 5", session="conversation-1")
    assert moved != home
    assert route(path, "turn 6", session="conversation-1") == moved  # bound where it went


def test_lora_prefers_running_then_free_slot_then_waiting() -> None:
    path, pool = path_of(A, B, C, prefix="off")
    record_engine_info(pool.get(A), None, None, (frozenset({"other"}), frozenset(), 1))  # type: ignore[arg-type]
    record_engine_info(pool.get(B), None, None, (frozenset({"sql"}), frozenset(), 2))  # type: ignore[arg-type]
    record_engine_info(pool.get(C), None, None, (frozenset(), frozenset(), 2))  # type: ignore[arg-type]
    picks = [path.admit(request("x", model="sql")).payload.picked[0] for _ in range(3)]
    assert picks[0] == B  # running there
    pool.drain(B)
    assert path.admit(request("x", model="sql")).payload.picked[0] == C  # a free adapter slot


def test_the_engines_report_corrects_the_index_capacity() -> None:
    path, pool = path_of(A)
    route(path, SYSTEM + "q0")
    record = path.admit(request(SYSTEM + "q1")).payload
    assert record.predicted_blocks == 9
    path.response_started(record, 200, A, streaming=True)
    tracker = record.tracker
    assert isinstance(tracker, ResponseTracker)
    tracker.usage_prompt_tokens, tracker.usage_cached_tokens = 600, 0  # the engine had nothing
    before = pool.get(A).prefix.capacity  # type: ignore[union-attr]
    tracker.done = True
    path.response_ended(record, True, EndReason.COMPLETED)
    assert pool.get(A).prefix.capacity == before  # one report is not enough to judge
    index = pool.get(A).prefix  # type: ignore[union-attr]
    for _ in range(50):
        index.observed(9, 5)  # a window of reports, all short: the engine evicts sooner
    assert index.capacity < before and len(index) > 0
    shrunk = index.capacity
    for _ in range(100):  # two windows: the first still holds a short report
        index.observed(9, 9)
    assert index.capacity > shrunk
    for _ in range(50):
        index.observed(9, 0)  # nothing cached at all, again and again: the engine lost its cache
    assert len(index) == 0


def test_the_index_keeps_the_recent_half_and_is_bounded() -> None:
    index = PrefixIndex(capacity=128)
    for prompt in range(100):
        index.add([prompt * 1000 + block for block in range(10)])
    assert 128 <= len(index) <= 256  # at least the capacity, at most twice it
    assert all(99_000 + block in index for block in range(10))  # the last prompt's blocks stay
    assert 0 not in index  # the first one's went


@pytest.mark.parametrize("cached", [0.0, 0.9])
def test_saturated_endpoints_are_never_the_primary_whatever_they_hold(cached: float) -> None:
    from picker.pool.scrapes import record_sample

    pool = Pool()
    pool.apply(ready=[A, B])
    record_sample(pool.get(A), running=10, waiting=3, kv_usage=0.5, now=0.0)  # type: ignore[arg-type]
    record_sample(pool.get(B), running=1, waiting=0, kv_usage=0.1, now=0.0)  # type: ignore[arg-type]
    choice = pick_with_affinity(
        pool.ready(),
        [Affinity(cached=cached), Affinity()],
        2,
        random.Random(1),
        0.0,
        LoadPolicy(),
        AffinityPolicy.of(AffinityConfig()),
    )
    assert choice.destinations[0] == B


def test_keys_cut_before_the_block_size_changed_stay_out_of_the_new_index() -> None:
    """The index's binary search needs one block size an index: a request routed before the engines
    published a larger one, and served (or resumed) after, adds nothing to the index cut anew."""
    path, pool = path_of(A)
    record = path.admit(request(SYSTEM + "q"), flow="f").payload  # type: ignore[arg-type]
    assert record.keys.block_tokens == 64
    record_engine_info(pool.get(A), 128, None, None)  # type: ignore[arg-type]
    path.placement.tune()
    assert path.placement.block_tokens == 128 and pool.get(A).prefix is None  # type: ignore[union-attr]
    path.placement.dispatched(record, A)  # a fallback served it, or a resume moved it, after
    index = pool.get(A).prefix  # type: ignore[union-attr]
    assert index is None or len(index) == 0
    fresh = path.admit(request(SYSTEM + "q"), flow="f").payload  # type: ignore[arg-type]
    assert fresh.keys.block_tokens == 128 and len(pool.get(A).prefix) == len(fresh.keys.blocks)  # type: ignore[union-attr]
