"""A replica that fails fast must not attract traffic (issue 13, item 1), and drain records count
what clients saw: failures before the record opened, and streams the engine stopped sending."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import yaml

from picker.observability.metrics import Metrics
from picker.pool import DrainEnd, Pool
from picker.pool.health import Health, SuspectPolicy
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import pick
from picker.streams import Attempts, EndReason

A, B, C = "a:1", "b:1", "c:1"
DRAIN_500 = json.dumps(
    {
        "error": {
            "message": "cannot schedule new futures after shutdown",
            "type": "InternalServerError",
            "code": 500,
        }
    }
).encode()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def sse(text: str = "tok") -> bytes:
    event = {"id": "c", "object": "text_completion", "created": 1, "model": "m"}
    event["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]  # type: ignore[assignment]
    return f"data: {json.dumps(event)}\n\n".encode()


def test_failures_in_a_row_make_an_endpoint_suspect_with_doubling_backoff() -> None:
    clock = Clock()
    health = Health(SuspectPolicy(after=3, backoff_s=1.0, max_backoff_s=3.0), clock)
    assert not health.failed(A) and not health.failed(A)
    assert health.failed(A)  # the third in a row
    assert health.suspects() == {A} and health.suspected == 1
    clock.now = 0.99
    assert health.suspect(A)
    clock.now = 1.0
    assert not health.suspect(A)  # the first backoff is over: a primary again
    for _ in range(2):
        assert not health.failed(A)
    assert health.failed(A)  # suspect again, for twice as long
    clock.now = 2.99
    assert health.suspect(A)
    clock.now = 3.0
    assert not health.suspect(A)
    for _ in range(3):
        health.failed(A)
    clock.now = 5.99  # 4 s would be next: capped at max_backoff_s
    assert health.suspect(A)
    clock.now = 6.0
    assert not health.suspect(A)
    assert health.failures == 9 and health.suspected == 3


def test_a_success_clears_a_suspicion_and_its_count() -> None:
    clock = Clock()
    health = Health(SuspectPolicy(after=2), clock)
    health.failed(A)
    health.succeeded(A)
    assert not health.failed(A)  # the success broke the row
    assert health.failed(A)
    assert health.succeeded(A) and not health.suspect(A) and health.cleared == 1
    assert health.failed_within(A, 10.0) == 3  # failure times outlive the success (drain records)
    assert not health.succeeded(B)  # never failed: nothing to clear


def test_the_drain_refusal_makes_an_endpoint_suspect_at_once_for_the_longest_backoff() -> None:
    clock = Clock()
    health = Health(SuspectPolicy(after=3, backoff_s=1.0, max_backoff_s=30.0), clock)
    health.failed(A)
    assert health.shutting_down(A)
    assert not health.shutting_down(A)  # already suspect: one transition
    clock.now = 29.9
    assert health.suspect(A)
    assert health.suspected == 1


def test_never_suspect_when_disabled() -> None:
    health = Health(SuspectPolicy(after=0), Clock())
    for _ in range(10):
        assert not health.failed(A)
    assert health.suspects() == frozenset()


class Load:
    def __init__(self, address: str, in_flight: int = 0) -> None:
        self.address = address
        self.in_flight = in_flight
        self.arrivals = self.departures = self.learned_slots = self.peer_in_flight = self.peer_arrivals = 0
        self.superseded = 0
        self.load = None


def test_a_suspect_is_never_primary_and_listed_last_even_when_idlest() -> None:
    rng = random.Random(1)
    candidates = [Load(A, 0), Load(B, 5), Load(C, 9)]
    for _ in range(20):
        assert pick(candidates, 3, rng, last_resort=frozenset({A})) == [B, C, A]
    assert pick(candidates, 1, rng, last_resort=frozenset({A, B})) == [C]


def test_a_pool_of_suspects_still_gets_a_primary() -> None:
    candidates = [Load(A, 0), Load(B, 5)]
    assert pick(candidates, 2, random.Random(1), last_resort=frozenset({A, B})) == [A, B]


def path_over(pool: Pool, clock: Clock, fallbacks: int = 2) -> RequestPath:
    return RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=fallbacks,
        clock=clock,
        rng=random.Random(7),
        schedule=lambda delay, fn: lambda: None,
        cut_after_silence_s=5.0,
    )


def request(stream: bool = True) -> InferenceRequest:
    return InferenceRequest(method="POST", path="/v1/completions", model="m", stream=stream)


def test_envoy_moving_past_the_primary_counts_against_it_until_it_is_no_longer_picked() -> None:
    """The late-learning window: the primary answers vLLM's drain 500 at once and Envoy retries it on
    the next endpoint of the list; the picker sees only who served. Three of those and it is suspect."""
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B, C])
    path = path_over(pool, clock)
    failing = None
    for _ in range(50):
        record = path.admit(request()).payload
        primary = record.picked[0]
        if failing is None:
            failing = primary
        if primary == failing:
            path.response_started(record, 200, record.picked[1], streaming=True)  # Envoy moved on
        else:
            path.response_started(record, 200, primary, streaming=True)
        path.finish(record, EndReason.COMPLETED)
        if pool.health.suspect(failing):
            break
    assert failing is not None and pool.health.suspect(failing)
    assert pool.health.failures == 3
    for _ in range(20):  # no primary pick while suspect; still the last fallback
        record = path.admit(request()).payload
        assert record.picked[0] != failing and record.picked[-1] == failing
        path.response_started(record, 200, record.picked[0], streaming=True)
        path.finish(record, EndReason.COMPLETED)


def test_a_5xx_that_reached_the_client_counts_against_who_sent_it() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    path = path_over(pool, clock, fallbacks=0)
    for _ in range(3):
        record = path.admit(request(stream=False)).payload
        path.response_started(record, 502, A, streaming=False)
        path.finish(record, EndReason.UPSTREAM_ERROR_STATUS)
    assert pool.health.suspect(A)
    record = path.admit(request()).payload
    assert record.picked == (A,)  # the only endpoint: picked anyway, better than queueing forever
    path.response_started(record, 200, A, streaming=True)
    assert not pool.health.suspect(A)  # one good answer clears it


def test_vllms_drain_500_body_makes_its_endpoint_suspect_at_once() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B])
    path = path_over(pool, clock, fallbacks=0)
    record = path.admit(request(stream=False)).payload
    sender = record.picked[0]
    path.response_started(record, 500, sender, streaming=False)
    path.body_chunk(record, DRAIN_500)
    path.observer_ended(record, True)
    assert pool.health.suspect(sender) and pool.health.failures == 1
    for _ in range(10):
        assert path.admit(request()).payload.picked[0] != sender


def test_another_500_body_needs_failures_in_a_row() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    path = path_over(pool, clock, fallbacks=0)
    record = path.admit(request(stream=False)).payload
    path.response_started(record, 500, A, streaming=False)
    path.body_chunk(record, b'{"error": {"message": "EngineCore encountered an issue", "code": 500}}')
    assert not pool.health.suspect(A)


def test_a_drain_record_counts_the_failures_before_it_opened() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B])
    path = path_over(pool, clock)
    pool.failed_window_s = 10.0
    clock.now = 1.0
    pool.health.failed(A)  # long before: outside the window
    clock.now = 20.0
    for _ in range(4):
        record = path.admit(request()).payload
        if record.picked[0] != A:
            continue
        path.response_started(record, 200, record.picked[1], streaming=True)  # A failed, B served
        path.finish(record, EndReason.COMPLETED)
    failed = pool.health.failed_within(A, 10.0)
    assert failed >= 1
    clock.now = 22.0
    pool.apply(ready=[B], draining=[A])  # the picker learns of the drain 2 s later
    record = pool.get(A).drain  # type: ignore[union-attr]
    assert record is not None and record.failed_before_start == failed
    assert record.summary(clock.now)["failed_before_start"] == failed
    assert f"failed_before_start={failed}" in record.log_line(clock.now)


def test_a_client_leaving_a_stream_its_engine_stopped_sending_counts_as_cut() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    path = path_over(pool, clock, fallbacks=0)
    silent = path.admit(request()).payload
    lively = path.admit(request()).payload
    for record in (silent, lively):
        path.response_started(record, 200, A, streaming=True)
        path.body_chunk(record, sse())
    pool.apply(ready=[], draining=[A])
    clock.now = 4.0
    path.body_chunk(lively, sse())
    clock.now = 8.0  # silent: 8 s without a token; lively: 4 s
    flags = frozenset({"downstream_remote_reset"})
    for record in (silent, lively):
        path.observer_ended(record, False)
        path.access_logged(record.request_id, Attempts(flags=flags, status=200, upstream=A))
    assert silent.end_reason is EndReason.STALLED
    assert lively.end_reason is EndReason.CLIENT_DISCONNECT
    drain = pool.get(A).drain  # type: ignore[union-attr]
    assert drain is not None
    assert drain.ends[DrainEnd.CUT] == 1 and drain.ends[DrainEnd.CLIENT_DISCONNECT] == 1


def test_a_client_leaving_before_the_first_token_is_not_a_cut() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    path = path_over(pool, clock, fallbacks=0)
    record = path.admit(request()).payload
    path.response_started(record, 200, A, streaming=True)
    clock.now = 60.0  # queued on the engine a long time: the client gave up waiting
    path.finish(record, EndReason.CLIENT_DISCONNECT)
    assert record.end_reason is EndReason.CLIENT_DISCONNECT


def test_the_scorecard_shows_failures_before_the_drain_and_cuts() -> None:
    from picker.drain import scorecard
    from picker.pool.drain import DrainCause, DrainRecord

    drain = DrainRecord(
        address=A,
        cause=DrainCause.SOURCE,
        source="file",
        started_at=10.0,
        started_wall=1_800_000_000.0,
        in_flight_at_start=2,
        failed_before_start=7,
    )
    drain.request_ended(DrainEnd.COMPLETED, 1, 11.0)
    drain.request_ended(DrainEnd.CUT, 0, 12.0)
    (row,) = scorecard.score([drain.summary(13.0)], grace_s=30.0)
    assert row["failed_before_start"] == 7 and row["forced_cuts"] == 1
    header, line = scorecard.table([row]).splitlines()
    cells = dict(zip(header.split(" | "), line.split(" | "), strict=True))
    assert cells["failed_before"].strip() == "7" and cells["cut"].strip() == "1"


@pytest.mark.parametrize(
    ("change", "warned"),
    [
        ({}, False),  # the shipped policy: 500 retried, bounded
        ({"num_retries": 5}, True),  # a query of death could walk 6 replicas
        ({"retry_host_predicate": []}, True),  # ... or hit the same one again
    ],
    ids=["shipped", "many-retries", "no-previous-hosts"],
)
def test_picker_check_warns_about_an_unbounded_500_retry(
    tmp_path: Path, change: dict[str, object], warned: bool
) -> None:
    from picker.cli.envoyconf import EnvoyParams, render
    from picker.drain.check import check_paths
    from picker.drain.rules import Budget

    params = EnvoyParams(listen_port=8080, admin_port=9901, picker_port=9002, endpoints=["10.0.0.7:8000"])
    config = yaml.safe_load(render(params))
    listener = config["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    policy = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["retry_policy"]
    assert 500 in policy["retriable_status_codes"]
    policy.update(change)
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(config))
    report, _ = check_paths([tmp_path / "envoy.yaml"], Budget())
    assert any(f.rule.id == "ENVOY-004" for f in report.findings) is warned, report.findings


def test_attempts_that_never_got_a_response_count_from_the_access_log() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A, B, C])
    path = path_over(pool, clock)
    record = path.admit(request()).payload
    flags = frozenset({"upstream_connection_failure"})
    path.access_logged(record.request_id, Attempts(count=2, flags=flags, status=503))
    tried = record.picked[:2]
    assert all(pool.health.failed_within(a, 10.0) == 1 for a in tried)
    assert pool.health.failed_within(record.picked[2], 10.0) == 0
    answered = path.admit(request()).payload  # a response the picker saw is not counted twice
    path.response_started(answered, 503, answered.picked[0], streaming=True)
    path.access_logged(answered.request_id, Attempts(count=1, status=503))
    assert pool.health.failures == 3


def test_without_response_headers_the_access_log_clears_a_suspect_too() -> None:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=[A])
    path = path_over(pool, clock, fallbacks=0)
    for _ in range(3):
        record = path.admit(request()).payload
        path.access_logged(record.request_id, Attempts(count=1, status=502, upstream=A))
    assert pool.health.suspect(A)
    record = path.admit(request()).payload
    path.access_logged(record.request_id, Attempts(count=1, status=200, upstream=A))
    assert not pool.health.suspect(A)


def test_suspect_backoffs_must_be_ordered() -> None:
    from picker.config.model import SchedulingConfig

    with pytest.raises(ValueError, match="suspect_backoff_s"):
        SchedulingConfig(suspect_backoff_s=60.0, suspect_max_backoff_s=30.0)
    assert SchedulingConfig().suspect_after_failures == 3
