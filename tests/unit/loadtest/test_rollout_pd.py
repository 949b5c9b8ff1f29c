"""The P/D rollout benchmark's pure parts: counting pairs and pulls from the simulators' books, the
prompts it sends, streams cut after their first token, and the oracle's pairing."""

from __future__ import annotations

from loadtest.bench_pd_ttft import Oracle
from loadtest.rollout.load import LoadReport, Outcome
from loadtest.rollout.pd import PREFILLER, count_pairs, cut_after_first_token, prompt
from loadtest.sse_client import SseEvent, StreamResult

ROLES = {"p1": "prefill", "d1": "decode", "p1b": "prefill", "d1b": "decode"}
REVISIONS = {"p1": "v1", "d1": "v1", "p1b": "v2", "d1b": "v2"}


def test_a_decode_told_of_a_prefill_replica_of_another_revision_is_a_pair_across_revisions() -> None:
    requests = {
        "d1": [{"prefiller": "p1"}, {"prefiller": "p1b"}, {"prefiller": None}],
        "d1b": [{"prefiller": "p1b"}],
        "p1": [{"remote_decode": True, "prefiller": None}, {"remote_decode": False, "prefiller": None}],
    }
    kv = {"d1": {"pulls_failed": 2}, "d1b": {"pulls_failed": 0}, "p1": {}}
    counts = count_pairs(requests, kv, ROLES, REVISIONS)
    assert counts == {"pairs": 3, "cross": 1, "steps": 1, "on_prefill": 1, "pulls_failed": 2}


def test_prompts_are_the_size_asked_and_unique_from_their_first_block() -> None:
    for tokens in (64, 256, 1024):
        text = prompt(3, tokens)
        assert abs(len(text) / 4 - tokens) <= 1  # the simulator counts 4 characters a token
    assert prompt(1, 256)[:16] != prompt(2, 256)[:16]
    assert prompt(1, 256, "a")[:16] != prompt(1, 256, "b")[:16]


def _outcome(status: int, events: list[str]) -> Outcome:
    result = StreamResult(status=status)
    result.events = [SseEvent(data=d, at=0.01 * i) for i, d in enumerate(events)]
    return Outcome(0.0, result)


def test_only_a_stream_that_sent_a_token_and_did_not_complete_counts_as_cut() -> None:
    token = '{"choices":[{"text":"x","finish_reason":null}]}'
    end = '{"choices":[{"text":"","finish_reason":"length"}]}'
    report = LoadReport(
        [_outcome(200, [token, token]), _outcome(200, [token, end, "[DONE]"]), _outcome(500, [])]
    )
    assert cut_after_first_token(report) == 1


def test_the_oracle_sends_to_the_least_loaded_pair_and_takes_turns_on_ties() -> None:
    oracle = Oracle(["p1", "p2"], ["d1", "d2"])
    first = oracle.target(0)
    second = oracle.target(1)
    assert {first[0], second[0]} == {"http://d1", "http://d2"}
    assert {first[1][PREFILLER], second[1][PREFILLER]} == {"p1", "p2"}
    oracle.first(0)  # request 0's prefill is done: its prefill replica is the least loaded again
    assert oracle.target(2)[1][PREFILLER] == first[1][PREFILLER]
    oracle.done(0)
    oracle.done(1)
    assert oracle.open == {"d1": 0, "d2": 1} or oracle.open == {"d1": 1, "d2": 0}
    assert Oracle(["p1"], ["d1"], hop="never").target(0) == ("http://d1", {})


def test_the_sooner_oracle_hops_only_when_the_decode_replicas_own_backlog_is_longer() -> None:
    oracle = Oracle(["p1"], ["d1"], hop="sooner", tokens=4096)  # 205 ms a prompt, a hop costs 76 ms
    assert oracle.target(0) == ("http://d1", {})  # idle: computed in place
    assert oracle.target(1)[1] == {PREFILLER: "p1"}  # one prompt ahead on d1: the hop is sooner
    assert oracle.target(2) == ("http://d1", {})  # one on each side again
    assert Oracle(["p1"], ["d1"], hop="sooner", tokens=64).target(0) == ("http://d1", {})
