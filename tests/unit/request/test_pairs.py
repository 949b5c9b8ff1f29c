"""Prefill / decode pairs in the core: roles from labels, the decode replica as destination with the
prefill replica named beside it, the decider, pairs of one revision and one canary group, the books
of a hand-off and the drain that waits for it (or gives it up at its bound)."""

from __future__ import annotations

import random

import pytest

from picker.config.model import AffinityConfig, PdConfig, RolloutConfig
from picker.contract import headers
from picker.observability.metrics import Metrics
from picker.pool import DrainEnd, EndpointState, Pool, Role
from picker.pool.roles import role_of
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath, Routed
from picker.rollout import Canary
from picker.rollout.canary import CanaryPlan
from picker.streams import EndReason, RequestRecord

P1, P2, D1, D2, X = "10.0.1.1:8000", "10.0.1.2:8000", "10.0.2.1:8000", "10.0.2.2:8000", "10.0.3.1:8000"
LONG = "Summarise the attached report in three paragraphs. " * 60  # ~3,000 bytes: ~750 pseudo-tokens
SHORT = "hello there, " * 2  # 26 bytes: 6 pseudo-tokens
ROLE = "llm-d.ai/role"
VERSION = "app.kubernetes.io/version"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def labels(role: str | None, version: str = "v1") -> dict[str, str]:
    tags = {VERSION: version}
    if role is not None:
        tags[ROLE] = role
    return tags


def pool_of(entries: dict[str, dict[str, str]], clock: Clock) -> Pool:
    pool = Pool(clock=clock)
    pool.reconcile({a: EndpointState.READY for a in entries}, source="file", labels=entries)
    return pool


def path_of(pool: Pool, clock: Clock, **pd: object) -> RequestPath:
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=1,
        clock=clock,
        schedule=lambda d, f: lambda: None,
        affinity=AffinityConfig(prefix="approximate"),
        rng=random.Random(3),
        pd=PdConfig(**pd),  # type: ignore[arg-type]
    )
    pool.on_change(path.capacity_changed)
    return path


def send(path: RequestPath, prompt: str = LONG) -> tuple[RequestRecord, Routed]:
    ticket = path.admit(
        InferenceRequest("POST", "/v1/completions", model="m", stream=True, prompt=prompt.encode())
    )
    decision = path.settle(ticket)
    assert isinstance(decision, Routed), decision
    return decision.record, decision


def prefiller(routed: Routed) -> str | None:
    return dict(routed.headers).get(headers.PREFILLER)


def first_token(path: RequestPath, record: RequestRecord) -> None:
    path.response_started(record, 200, record.picked[0], streaming=True)
    path.body_chunk(record, b'data: {"choices":[{"text":"a"}]}\n\n')


def pd_pool(clock: Clock) -> Pool:
    return pool_of(
        {P1: labels("prefill"), P2: labels("prefill"), D1: labels("decode"), D2: labels("decode")}, clock
    )


def test_roles_come_from_the_llm_d_label_or_the_configured_one() -> None:
    assert role_of({ROLE: "prefill"}) is Role.PREFILL
    assert role_of({ROLE: "Decode "}) is Role.DECODE
    assert role_of({ROLE: "both"}) is Role.BOTH
    assert role_of({ROLE: "prefill-decode"}) is Role.BOTH
    assert role_of({"app": "vllm"}) is Role.BOTH  # no role label: an ordinary replica
    assert role_of(None) is Role.BOTH
    assert role_of({ROLE: "prefil"}) is None  # a typo names no role: the endpoint serves neither
    assert role_of({"team/role": "decode"}, ("team/role",)) is Role.DECODE
    clock = Clock()
    pool = pool_of({P1: {"team/role": "prefill"}, D1: {"team/role": "decode"}}, clock)
    path_of(pool, clock, role_label="team/role")
    assert pool.get(P1).role is Role.PREFILL  # type: ignore[union-attr]


def test_a_pool_without_prefill_only_replicas_is_routed_as_before() -> None:
    clock = Clock()
    pool = pool_of({D1: labels("decode"), D2: labels(None)}, clock)
    path = path_of(pool, clock)
    assert not path.pairing.active
    record, routed = send(path)
    assert prefiller(routed) is None and record.pull is None


def test_the_destination_is_a_decode_replica_and_the_prefill_replica_is_named_beside_it() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    for i in range(8):
        record, routed = send(path, str(i) + LONG)  # a prompt neither decode replica holds
        assert routed.destinations[0] in (D1, D2)
        assert set(routed.destinations) <= {D1, D2}  # a prefill-only replica is never a destination
        assert prefiller(routed) in (P1, P2)
        path.finish(record, EndReason.COMPLETED)


def test_both_replicas_are_counted_while_the_pair_lives_and_the_prefill_leaves_at_the_first_token() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    record, routed = send(path)
    prefill, decode = pool.get(prefiller(routed) or ""), pool.get(routed.destinations[0])
    assert prefill is not None and decode is not None
    assert (prefill.in_flight, prefill.pulls, decode.in_flight) == (1, 1, 1)
    first_token(path, record)
    assert (prefill.in_flight, prefill.pulls, decode.in_flight) == (0, 0, 1)
    path.finish(record, EndReason.COMPLETED)
    assert decode.in_flight == 0


def test_the_prefill_replica_is_the_one_with_the_smaller_prefill_backlog() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    pool.get(P1).pending_prefill = 50_000.0  # type: ignore[union-attr]
    assert all(prefiller(send(path, str(i) + LONG)[1]) == P2 for i in range(4))


def test_the_prefill_replica_holding_the_prompt_prefills_it_again() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    record, routed = send(path)
    first = prefiller(routed)
    path.finish(record, EndReason.COMPLETED)
    pool.drain(routed.destinations[0])  # the decode replica that holds it is going: the other pulls
    record, routed = send(path, LONG + "?")
    assert prefiller(routed) == first
    path.finish(record, EndReason.COMPLETED)
    # ... and now holds it too: the next turn takes no hop
    assert prefiller(send(path, LONG + "!")[1]) is None


def test_a_short_prompt_is_computed_by_the_decode_replica_itself() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock, prefill_min_tokens=256)
    record, routed = send(path, SHORT)
    assert routed.destinations[0] in (D1, D2) and prefiller(routed) is None and record.pull is None
    assert prefiller(send(path, LONG)[1]) is not None
    assert prefiller(send(path_of(pool, clock, prefill_min_tokens=0), SHORT)[1]) is not None


def test_a_prompt_the_decode_replica_already_holds_takes_no_prefill_hop() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    record, routed = send(path)
    assert prefiller(routed) is not None
    first_token(path, record)
    path.finish(record, EndReason.COMPLETED)
    home = routed.destinations[0]
    again, routed = send(path, LONG + "?")
    assert again.picked[0] == home  # the prefix is there
    assert prefiller(routed) is None  # ... so the decode replica computes the rest itself


def test_a_draining_prefill_replica_gets_no_new_prefill() -> None:
    clock = Clock()
    pool = pd_pool(clock)
    path = path_of(pool, clock)
    pool.drain(P1)
    assert all(prefiller(send(path, str(i) + LONG)[1]) == P2 for i in range(6))
    pool.drain(P2)
    _, routed = send(path)  # no prefill replica ready: the decode replica computes the prompt
    assert routed.destinations[0] in (D1, D2) and prefiller(routed) is None


def test_a_drain_counts_the_pulls_still_pending_and_ends_when_they_are_pulled() -> None:
    clock = Clock()
    pool = pool_of({P1: labels("prefill"), D1: labels("decode")}, clock)
    path = path_of(pool, clock)
    records = [send(path, str(i) + LONG)[0] for i in range(3)]
    pool.drain(P1)
    drain = pool.get(P1).drain  # type: ignore[union-attr]
    assert drain is not None and drain.pulls_at_start == 3 and drain.in_flight_at_start == 3
    for record in records:
        first_token(path, record)
    assert drain.ends[DrainEnd.PULLED] == 3 and drain.zero_at == clock.now
    assert drain.summary(clock.now)["pulls_at_start"] == 3


def test_pulls_not_taken_by_the_bound_are_abandoned_so_the_drain_ends() -> None:
    clock = Clock()
    pool = pool_of({P1: labels("prefill"), P2: labels("prefill"), D1: labels("decode")}, clock)
    path = path_of(pool, clock)
    pool.drain(P2)
    record, routed = send(path)
    assert prefiller(routed) == P1
    pool.drain(P1)
    clock.now += 29.0
    assert path.sweep_pulls(30.0) == 0  # within the bound: the drain waits for the pull
    assert pool.get(P1).in_flight == 1  # type: ignore[union-attr]
    clock.now += 1.0
    assert path.sweep_pulls(30.0) == 1
    endpoint = pool.get(P1)
    assert endpoint is not None and endpoint.in_flight == 0 and endpoint.pulls == 0
    assert endpoint.drain is not None and endpoint.drain.ends[DrainEnd.PULL_ABANDONED] == 1
    assert pool.get(D1).in_flight == 1  # type: ignore[union-attr]  # the request itself goes on
    first_token(path, record)  # the decode side recomputed: nothing is released twice
    assert endpoint.in_flight == 0 and endpoint.drain.ends[DrainEnd.PULLED] == 0


def test_a_request_that_fails_before_its_first_token_ends_its_hand_off_as_it_ended() -> None:
    clock = Clock()
    pool = pool_of({P1: labels("prefill"), D1: labels("decode")}, clock)
    path = path_of(pool, clock)
    record, _ = send(path)
    pool.drain(P1)
    path.finish(record, EndReason.UPSTREAM_ERROR_STATUS)
    endpoint = pool.get(P1)
    assert endpoint is not None and endpoint.in_flight == 0
    assert endpoint.drain is not None and endpoint.drain.ends[DrainEnd.UPSTREAM_ERROR] == 1


@pytest.mark.parametrize(
    ("step", "versions", "expect"),
    [
        # prefill x2 + decode x2 replaced one by one, v1 -> v2: at each step, the pairs offered
        ("start", {P1: "v1", P2: "v1", D1: "v1", D2: "v1"}, {"v1"}),
        ("P1 replaced", {P1: "v2", P2: "v1", D1: "v1", D2: "v1"}, {"v1"}),  # v2 has no decode yet
        ("D1 replaced", {P1: "v2", P2: "v1", D1: "v2", D2: "v1"}, {"v1", "v2"}),
        ("P2 replaced", {P1: "v2", P2: "v2", D1: "v2", D2: "v1"}, {"v2"}),  # v1 has no prefill left
        ("D2 replaced", {P1: "v2", P2: "v2", D1: "v2", D2: "v2"}, {"v2"}),
    ],
)
def test_a_pair_never_spans_two_revisions_through_a_rollout(
    step: str, versions: dict[str, str], expect: set[str]
) -> None:
    clock = Clock()
    roles = {P1: "prefill", P2: "prefill", D1: "decode", D2: "decode"}
    pool = pool_of({a: labels(roles[a], versions[a]) for a in roles}, clock)
    path = path_of(pool, clock)
    seen = set()
    for i in range(24):
        record, routed = send(path, str(i) + LONG)
        decode, prefill = routed.destinations[0], prefiller(routed)
        assert prefill is not None, step
        assert versions[decode] == versions[prefill], step
        assert all(versions[d] == versions[decode] for d in routed.destinations), step  # fallbacks too
        seen.add(versions[decode])
        path.finish(record, EndReason.COMPLETED)
    assert seen == expect, step


def test_with_no_complete_pair_the_decode_replicas_serve_alone() -> None:
    clock = Clock()
    pool = pool_of({P1: labels("prefill", "v2"), D1: labels("decode", "v1")}, clock)
    path = path_of(pool, clock)
    record, routed = send(path)
    assert routed.destinations == (D1,) and prefiller(routed) is None and record.unpaired


def test_a_canary_pairs_within_its_group() -> None:
    clock = Clock()
    entries = {
        P1: labels("prefill", "v1"),
        P2: labels("prefill", "v2"),
        D1: labels("decode", "v1"),
        D2: labels("decode", "v2"),
        X: labels("both", "v2"),
    }
    pool = pool_of(entries, clock)
    path = path_of(pool, clock)
    path.canary = Canary(
        CanaryPlan.of(RolloutConfig(group_label=VERSION, stable="v1", candidate="v2", steps=(50, 100))),
        clock.now,
    )
    groups = set()
    for i in range(40):
        record, routed = send(path, str(i) + LONG)
        prefill = prefiller(routed)
        assert prefill is not None
        assert entries[prefill][VERSION] == entries[routed.destinations[0]][VERSION]
        groups.add(entries[routed.destinations[0]][VERSION])
        path.finish(record, EndReason.COMPLETED)
    assert groups == {"v1", "v2"}


def test_an_endpoint_whose_role_label_names_no_role_takes_no_work() -> None:
    clock = Clock()
    pool = pool_of({P1: labels("prefill"), D1: labels("decode"), X: labels("decoder")}, clock)
    path = path_of(pool, clock)
    assert pool.get(X).role is None  # type: ignore[union-attr]
    for i in range(10):
        record, routed = send(path, str(i) + LONG)
        assert X not in routed.destinations and prefiller(routed) != X
        path.finish(record, EndReason.COMPLETED)


def test_the_endpoints_file_names_roles_and_refuses_one_it_does_not_know() -> None:
    from picker.sources.static_file import EndpointsFileError, read_endpoints

    _, tags = read_endpoints(
        "- {address: 10.0.0.1:8000, role: prefill}\n"
        "- {address: 10.0.0.2:8000, role: decode, labels: {app.kubernetes.io/version: v2}}\n"
        "- 10.0.0.3:8000\n"
    )
    assert tags["10.0.0.1:8000"] == {ROLE: "prefill"}
    assert tags["10.0.0.2:8000"] == {ROLE: "decode", VERSION: "v2"}
    assert "10.0.0.3:8000" not in tags
    with pytest.raises(EndpointsFileError, match="'role' must be one of prefill, decode, both"):
        read_endpoints("- {address: 10.0.0.1:8000, role: prefil}\n")


def test_another_picker_counts_a_hand_off_on_its_prefill_replica_until_the_pull() -> None:
    from picker.peers.books import Peering
    from tests.unit.peers.test_peering import deliver

    names = ("10.1.0.1:9004", "10.1.0.2:9004")
    entries = {P1: labels("prefill"), D1: labels("decode")}

    class Picker:
        def __init__(self, name: str) -> None:
            self.pool = pool_of(entries, Clock())
            self.peering = Peering(name, names, self.pool)
            self.path = RequestPath(
                self.pool,
                Metrics(pool="default"),
                fallback_count=0,
                schedule=lambda d, f: lambda: None,
                peering=self.peering,
                affinity=AffinityConfig(prefix="approximate"),
            )

    a, b = Picker(names[0]), Picker(names[1])
    record, routed = send(a.path)
    assert prefiller(routed) == P1
    deliver(a, b)  # type: ignore[arg-type]
    prefill, decode = b.pool.get(P1), b.pool.get(D1)
    assert prefill is not None and decode is not None
    assert (prefill.peer_in_flight, decode.peer_in_flight) == (1, 1)
    # a drain-wait asking the other picker hears of the pull too (GET /admin/endpoints/<address>)
    from picker.admin.api import describe

    assert describe(b.pool, prefill)["kv_pulls_pending"] == 1
    assert describe(b.pool, decode)["kv_pulls_pending"] == 0
    a.peering.sync([record])  # books resent whole keep the hand-off while it waits
    deliver(a, b)  # type: ignore[arg-type]
    assert prefill.peer_in_flight == 1
    first_token(a.path, record)
    deliver(a, b)  # type: ignore[arg-type]
    assert (prefill.peer_in_flight, decode.peer_in_flight) == (0, 1)
    assert describe(b.pool, prefill)["kv_pulls_pending"] == 0
    a.peering.sync([record])
    deliver(a, b)  # type: ignore[arg-type]
    assert prefill.peer_in_flight == 0


def test_in_a_pool_without_prefill_replicas_an_invalid_role_still_takes_no_work() -> None:
    clock = Clock()
    pool = pool_of({D1: labels(None), D2: labels("decoder")}, clock)
    path = path_of(pool, clock)
    for i in range(6):
        record, routed = send(path, str(i) + LONG)
        assert routed.destinations == (D1,) and prefiller(routed) is None
        path.finish(record, EndReason.COMPLETED)


def test_pairs_are_judged_for_the_requests_model() -> None:
    """With scheduling.by_model, a prefill replica that does not serve the request's model is no
    pair for it: a model whose revision has no prefill replica of its own is decoded alone, never
    handed to a replica that would answer 404 (or left waiting for a pair that cannot come)."""
    from picker.pool.served import Served

    clock = Clock()
    pool = pool_of({P1: labels("prefill"), D1: labels("decode"), D2: labels("decode")}, clock)
    for address, model in ((P1, "a"), (D1, "a"), (D2, "b")):
        pool.get(address).served = Served(frozenset({model}), None)  # type: ignore[union-attr]
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=1,
        clock=clock,
        schedule=lambda d, f: lambda: None,
        affinity=AffinityConfig(prefix="approximate"),
        rng=random.Random(3),
        by_model=True,
    )

    def send_model(model: str, i: int) -> Routed:
        request = InferenceRequest(
            "POST", "/v1/completions", model=model, stream=True, prompt=f"{i} {LONG}".encode()
        )
        decision = path.settle(path.admit(request))
        assert isinstance(decision, Routed), decision
        return decision

    for i in range(4):
        b, a = send_model("b", i), send_model("a", i)
        assert b.destinations == (D2,) and prefiller(b) is None and b.record.unpaired
        assert a.destinations == (D1,) and prefiller(a) == P1


def test_a_decode_that_answers_an_error_ends_its_hand_off_as_failed_not_pulled() -> None:
    """A decode whose pull failed answers 500 (vLLM's kv_load_failure_policy: fail), or an error
    event in a stream it started: the prefill replica's drain record says so, not `kv-pulled`."""
    clock = Clock()
    pool = pool_of({P1: labels("prefill"), D1: labels("decode")}, clock)
    path = path_of(pool, clock)
    failed, _ = send(path, "1 " + LONG)
    errored, _ = send(path, "2 " + LONG)
    pool.drain(P1)
    path.response_started(failed, 500, D1, streaming=False)
    path.body_chunk(failed, b'{"error":{"message":"KV transfer failed","code":500}}')
    path.response_started(errored, 200, D1, streaming=True)
    path.body_chunk(errored, b'data: {"error":{"message":"KV load failed","code":500}}\n\n')
    drain = pool.get(P1).drain  # type: ignore[union-attr]
    assert drain is not None and drain.ends[DrainEnd.PULLED] == 0
    assert drain.ends[DrainEnd.UPSTREAM_ERROR] == 2 and pool.get(P1).pulls == 0  # type: ignore[union-attr]
