"""Prefix affinity as it meets a real engine: a tokenizer denser than the index's bytes / 4, a cache
smaller than the index believes, and prefixes the index says two endpoints hold.

On two real vLLM engines (a 40-block cache, six groups of long shared prompts) the index believed each
engine held every group (its pseudo-tokens are a third of vLLM's tokens, and a floor of 64 blocks
kept it from following a small cache), so a group alternated between the two by their prefill
backlog and neither engine kept it. These checks pin the two rules that keep a group on one engine.
"""

from __future__ import annotations

from picker.config.model import AffinityConfig
from picker.pool.cache import PrefixIndex
from picker.pool.scrapes import record_engine_info
from picker.request import index_size
from picker.scheduling import filters
from picker.scheduling.choice import AffinityPolicy, choose
from picker.scheduling.rows import Row
from picker.streams import EndReason, ResponseTracker
from tests.unit.request.test_affinity import SYSTEM, A, B, path_of, request, route


def test_a_prefix_two_endpoints_hold_stays_with_the_one_it_was_routed_to_last() -> None:
    path, pool = path_of(A, B)
    home = route(path, SYSTEM + "q0")
    other = B if home == A else A
    pool.drain(home)
    assert route(path, SYSTEM + "q1") == other  # both hold it now; `other` took it last
    pool.undrain(home)
    # the one it went to first has the lighter prefill backlog: by that alone, it would take it back,
    # and the two would trade it (and evict it) from then on
    pool.get(other).pending_prefill = 400.0  # type: ignore[union-attr]
    assert all(route(path, SYSTEM + f"q{i}") == other for i in range(2, 8))


def test_of_two_holders_the_one_holding_more_of_the_prompt_wins_over_the_later_one() -> None:
    path, pool = path_of(A, B)
    conversation = SYSTEM + "turn one, a long answer " * 40
    home = route(path, conversation)
    other = B if home == A else A
    pool.drain(home)
    assert route(path, SYSTEM + "another question") == other  # the system prompt alone, later
    pool.undrain(home)
    assert route(path, conversation + " turn two") == home  # the whole conversation is there


def test_routed_at_is_when_the_deepest_held_block_was_routed() -> None:
    index = PrefixIndex(1000)
    index.add((1, 2, 3), stamp=5)
    index.add((1, 2), stamp=9)
    assert index.routed_at((1, 2, 3), index.matched((1, 2, 3))) == 5
    assert index.routed_at((1, 2, 7), index.matched((1, 2, 7))) == 9
    assert index.routed_at((8,), index.matched((8,))) == 0


def test_the_index_is_sized_in_the_engines_own_tokens() -> None:
    """An engine that counts 2.5 tokens where the index counts one holds 2.5 times fewer of the
    index's blocks than its published 40 x 128 tokens: the index follows, once the engines' reported
    prompt sizes say so."""
    path, pool = path_of(A, block_tokens=128)
    endpoint = pool.get(A)
    assert endpoint is not None
    record_engine_info(endpoint, 128, 40, None)
    path.capacity_changed()
    route(path, SYSTEM + "q0")
    assert endpoint.prefix is not None and endpoint.prefix.bound == 40  # 40 x 128 tokens, 128 a block
    for i in range(40):
        record = path.admit(request(SYSTEM + f"q{i}")).payload
        path.response_started(record, 200, A, streaming=True)
        tracker = record.tracker
        assert isinstance(tracker, ResponseTracker)
        tracker.usage_prompt_tokens = int(record.keys.estimated_tokens * 2.5)  # type: ignore[union-attr]
        tracker.usage_cached_tokens = tracker.usage_prompt_tokens
        tracker.done = True
        path.response_ended(record, True, EndReason.COMPLETED)
    path.capacity_changed()
    assert endpoint.prefix.bound == 16  # 40 x 128 / 2.5 tokens, in blocks of 128
    assert endpoint.prefix.capacity <= 16


def test_less_than_a_request_above_the_mean_is_not_out_of_balance() -> None:
    """Two engines at two requests in all: one that averaged 1.6 over the last seconds against the
    other's 0.4 keeps its prefixes (moving one costs a whole prefill there and evicts another); a
    hot prefix's endpoint more than a fifth and a request above a loaded pool's mean still spreads."""
    policy = AffinityPolicy.of(AffinityConfig())
    holder = Row(A, False, False, False, 1.0, 0.0, 1.0, load_avg=1.6)
    other = Row(B, False, False, False, 0.0, 0.0, 0.0, load_avg=0.4)
    assert holder in filters.in_range([other, holder], policy)
    hot = Row(A, False, False, False, 8.0, 0.0, 8.0, load_avg=9.5)
    cool = Row(B, False, False, False, 4.0, 0.0, 4.0, load_avg=3.5)
    assert hot not in filters.in_range([cool, hot], policy)


def test_without_a_routing_clock_the_backlog_still_decides_between_holders() -> None:
    """The engines' own KV events say what each holds (no `routed`): of two holders, the one with a
    tenth more of the prompt but 20,000 tokens of backlog does not keep it from an idle one."""
    policy = AffinityPolicy.of(AffinityConfig())
    busy = Row(A, False, False, False, 0.0, 0.0, 0.0, cached=1.0, prefill=20_000.0)
    idle = Row(B, False, False, False, 0.0, 0.5, 0.0, cached=0.9, prefill=400.0)
    assert choose([busy, idle], 1, policy).destinations == [B]


def test_the_engines_tokens_per_pseudo_token_are_weighed_by_size() -> None:
    """Short chat prompts whose template the engine counts (5 pseudo-tokens reported as 25) beside
    long ones at the true 2.5: averaged report by report the ratio would read about 3.8; weighed by
    their tokens it stays near 2.5, which is what the cache holds."""
    ratio = index_size.TokenRatio()
    assert ratio.value == 1.0  # nothing reported: the index's own tokens
    for _ in range(40):
        ratio.add(25, 5)
        ratio.add(2_500, 1_000)
    assert 2.5 <= ratio.value < 2.6
    ratio.add(10**9, 1)
    assert ratio.value == index_size.MAX_RATIO  # bounded whatever an engine reports
