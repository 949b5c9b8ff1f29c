"""Routing by predicted latency in the core (issue 43): the pick prefers the replica predicted to
finish first within the latency gap, the SLO headers are read whole (or refused with a 400), a
request goes where its SLO is predicted to be met, and a sheddable one no replica can serve in time
gets the contract's refusal while a critical one is routed."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from picker.config.model import AffinityConfig
from picker.contract import Outcome
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.hints import HintRules, read_hints
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.scheduling.affinity import Affinity, AffinityPolicy, pick_with_affinity
from picker.scheduling.latency import tpot_features, ttft_features
from picker.streams import EndReason, ResponseTracker
from picker.streams.record import Slo

FAST, SLOW = "10.0.0.1:8000", "10.0.0.2:8000"
POLICY = AffinityPolicy.of(AffinityConfig(latency=True))


def pick(affinities: list[Affinity], slo: tuple[float | None, float | None] | None = None) -> str:
    pool = Pool()
    pool.apply(ready=[FAST, SLOW])
    choice = pick_with_affinity(
        pool.ready(), affinities, 2, random.Random(1), 0.0, LoadPolicy(use_metrics=False), POLICY, slo=slo
    )
    return choice.destinations[0]


def test_the_replica_predicted_to_finish_first_wins_unless_another_holds_the_prompt() -> None:
    quick = Affinity(ttft_s=0.05, tpot_s=0.01, latency_s=0.37)
    slow = Affinity(cached=0.1, ttft_s=0.06, tpot_s=0.03, latency_s=0.99)
    assert pick([quick, slow]) == FAST
    # within the latency gap, what is cached decides as before (sticky prefix)
    near = Affinity(cached=1.0, ttft_s=0.03, tpot_s=0.011, latency_s=0.38)
    assert pick([quick, near]) == SLOW
    # a holder slower to decode keeps its prefix while its first token comes within the gap:
    # moving the prefix would compute it again on the quick replica and evict another one there
    slow_but_cached = Affinity(cached=1.0, ttft_s=0.03, tpot_s=0.03, latency_s=0.99)
    assert pick([quick, slow_but_cached]) == SLOW
    # ... and loses it once its first token falls behind (its queue, its backlog of prefills)
    behind = Affinity(cached=1.0, ttft_s=0.3, tpot_s=0.03, latency_s=1.26)
    assert pick([quick, behind]) == FAST


def test_an_slo_prefers_a_replica_predicted_to_meet_it() -> None:
    first_token_soon = Affinity(ttft_s=0.05, tpot_s=0.03, latency_s=1.0)
    finishes_first = Affinity(ttft_s=0.07, tpot_s=0.02, latency_s=0.72)
    assert pick([first_token_soon, finishes_first]) == SLOW
    assert pick([first_token_soon, finishes_first], slo=(0.06, None)) == FAST
    assert pick([first_token_soon, finishes_first], slo=(0.01, None)) == SLOW  # none can: the best
    waits_for_a_slot = Affinity(ttft_s=0.4, tpot_s=0.01, latency_s=0.72)  # out of the TTFT gap
    assert pick([first_token_soon, waits_for_a_slot]) == FAST


def header_of(values: dict[str, str]):  # type: ignore[no-untyped-def]
    return lambda name: values.get(name)


def test_slo_headers_are_read_in_both_spellings_and_a_bad_one_is_a_400() -> None:
    rules = HintRules(slo_headers=True)
    hints = read_hints(header_of({"x-slo-ttft-ms": "500", "x-llm-d-slo-tpot-ms": "50"}), rules, None, bool)
    assert not isinstance(hints, type(None)) and getattr(hints, "slo", None) == Slo(0.5, 0.05)
    for bad in ("soon", "0", "-5", "nan", "inf", "1e99"):
        refused = read_hints(header_of({"x-slo-ttft-ms": bad}), rules, None, bool)
        assert getattr(refused, "outcome", None) is Outcome.BAD_REQUEST, bad
    off = read_hints(header_of({"x-slo-ttft-ms": "soon"}), HintRules(), None, bool)
    assert getattr(off, "slo", "x") is None  # not read without affinity.latency


def path_with_model(
    load_policy: LoadPolicy | None = None,
    clock: Callable[[], float] = time.monotonic,
    latency: str = "on",
    alike: bool = False,
    peered: bool = False,
) -> tuple[RequestPath, Pool]:
    """FAST answers in 50 ms (10 ms a token), SLOW in 400 (40), as the model learned them; `alike`:
    both as FAST. `peered`: the picker has a peer (its books shared)."""
    from picker.peers.books import Peering

    pool = Pool()
    pool.apply(ready=[FAST, SLOW])
    me, other = "10.1.0.1:9004", "10.1.0.2:9004"
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=1,
        schedule=lambda d, f: lambda: None,
        affinity=AffinityConfig(prefix="off", latency=latency),  # type: ignore[arg-type]
        rng=random.Random(3),
        load_policy=load_policy,
        clock=clock,
        peering=Peering(me, (me, other), pool) if peered else None,
    )
    model = path.placement.latency
    assert model is not None
    slow = (0.05, 0.01) if alike else (0.4, 0.04)
    for i in range(40):
        for address, (ttft, tpot) in ((FAST, (0.05, 0.01)), (SLOW, slow)):
            model.learn_ttft(address, ttft_features(0, 0), ttft, i * 0.05)
            model.learn_tpot(address, tpot_features(1), tpot, i * 0.05)
    return path, pool


REQUEST = InferenceRequest("POST", "/v1/completions", model="m", stream=True, max_tokens=16)


def test_sheddable_requests_no_replica_can_serve_in_time_are_refused_and_critical_ones_routed() -> None:
    path, _ = path_with_model()
    shed = path.admit(REQUEST, priority=-1, slo=Slo(0.01, None))
    reply = path.settle(shed)
    assert getattr(reply, "outcome", None) is Outcome.REJECTED_SLO_UNATTAINABLE
    assert getattr(reply, "retry_after_s", None)
    critical = path.admit(REQUEST, priority=0, slo=Slo(0.01, None)).payload
    assert critical.picked and critical.picked[0] == FAST
    attainable = path.admit(REQUEST, priority=-1, slo=Slo(0.2, None)).payload
    assert attainable.picked and attainable.picked[0] == FAST


def test_the_model_learns_from_the_requests_the_picker_routes() -> None:
    path, pool = path_with_model()
    model = path.placement.latency
    assert model is not None
    before = model.replicas[FAST].ttft.weight
    record = path.admit(REQUEST).payload
    assert record.picked[0] == FAST and record.ttft_x is not None and record.dispatched_at is not None
    record.tracker = ResponseTracker(streaming=True)
    record.status = 200
    path.body_chunk(record, b'data: {"choices":[{"text":" a","finish_reason":null}]}\n\n')
    path.body_chunk(record, b'data: {"choices":[{"text":" b","finish_reason":"length"}]}\n\ndata: [DONE]\n\n')
    path.finish(record, EndReason.COMPLETED)
    assert record.ttft_x is None  # learned once
    assert model.replicas[FAST].ttft.weight != before
    assert pool.get(FAST) is not None


def test_sheddable_work_without_an_slo_gives_way_to_the_critical_requests_objectives() -> None:
    """At overload the critical requests cannot be refused, so their SLOs hold only if the sheddable
    work gives way: while critical requests ask for a first token sooner than any replica is
    predicted to give one, a sheddable request without an SLO of its own is refused as saturated;
    once no critical request has asked for a while, it is admitted again."""
    path, _ = path_with_model()
    before = path.admit(REQUEST, priority=-1)
    assert before.payload.picked  # no critical objective seen: admitted
    path.admit(REQUEST, priority=0, slo=Slo(0.01, None))  # a critical request no replica can meet
    shed = path.settle(path.admit(REQUEST, priority=-1))
    assert getattr(shed, "outcome", None) is Outcome.REJECTED_SATURATED
    assert getattr(shed, "retry_after_s", None)
    critical = path.admit(REQUEST, priority=0).payload
    assert critical.picked  # critical work is never shed
    path.admit(REQUEST, priority=0, slo=Slo(0.2, None))  # one the quick replica meets: no pressure
    assert path.admit(REQUEST, priority=-1).payload.picked


async def test_queued_requests_with_a_ttft_objective_go_first_when_room_frees() -> None:
    """Every slot taken: requests queue in the picker. When one slot frees, the request that must see
    its first token soon takes it, ahead of those queued before it without an objective (within its
    priority: the sheddable still wait for the critical)."""
    now = [10.0]
    pool = Pool()
    pool.apply(ready=[FAST])
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=0,
        schedule=lambda d, f: lambda: None,
        affinity=AffinityConfig(prefix="off", latency=True),
        load_policy=LoadPolicy(engine_slots=1),
        clock=lambda: now[0],
        rng=random.Random(3),
    )
    endpoint = pool.get(FAST)
    assert endpoint is not None
    record_sample(endpoint, running=1.0, waiting=1.0, kv_usage=0.1, now=now[0])  # full: all queue
    tickets = {
        "sheddable": path.admit(REQUEST, priority=-1),
        "plain": path.admit(REQUEST),
        "slo": path.admit(REQUEST, slo=Slo(0.5, None)),
        "plain-2": path.admit(REQUEST),
    }
    assert not any(t.done for t in tickets.values())
    # its one slot taken, room for one more to wait on the engine (waiting_threshold 1)
    record_sample(endpoint, running=1.0, waiting=0.0, kv_usage=0.1, now=now[0])
    path.capacity_changed()
    assert [name for name, t in tickets.items() if t.done] == ["slo"]
    record_sample(endpoint, running=1.0, waiting=0.0, kv_usage=0.1, now=now[0])  # that one started
    path.capacity_changed()
    assert [name for name, t in tickets.items() if t.done] == ["plain", "slo"]


def test_a_request_waits_for_a_busy_replica_predicted_to_serve_it_much_sooner() -> None:
    """The quick replica has every slot taken; the slow one has room. Predicted to finish sooner on the
    quick one, its wait for a slot counted, by more than the latency gap, the request waits in the
    picker ("wait"); not when it is within the gap, not behind other waiting requests, and not when
    only the replica with room meets its SLO."""
    pool = Pool()
    pool.apply(ready=[FAST, SLOW])
    quick, slow = pool.get(FAST), pool.get(SLOW)
    assert quick is not None and slow is not None
    quick.in_flight = quick.arrivals = 2
    record_sample(quick, running=2, waiting=0, kv_usage=0.1, now=0.0)
    record_sample(slow, running=0, waiting=0, kv_usage=0.1, now=0.0)
    load = LoadPolicy(engine_slots=2, engine_queue=0)

    def choose(on_quick: Affinity, on_slow: Affinity, **kwargs: object) -> tuple[list[str], str]:
        choice = pick_with_affinity(
            pool.ready(), [on_quick, on_slow], 2, random.Random(1), 0.0, load, POLICY, **kwargs
        )
        return choice.destinations, choice.reason

    waits = Affinity(ttft_s=0.15, tpot_s=0.02, latency_s=0.8)  # a slot frees soon, then quick tokens
    slow_now = Affinity(ttft_s=0.12, tpot_s=0.04, latency_s=1.4)
    assert choose(waits, slow_now) == ([], "wait")
    assert choose(waits, slow_now, ahead=1)[0][0] == SLOW  # others wait already: not behind them
    near = Affinity(ttft_s=0.05, tpot_s=0.025, latency_s=0.9)
    assert choose(waits, near)[0][0] == SLOW  # within the gap: the replica with room
    assert choose(waits, slow_now, slo=(0.13, None))[0][0] == SLOW  # only it meets the SLO
    assert choose(waits, slow_now, slo=(0.2, None)) == ([], "wait")  # both do
    quick.in_flight = 1
    quick.departures = 1
    record_sample(quick, running=1, waiting=0, kv_usage=0.1, now=0.0)
    assert choose(waits, slow_now)[0][0] == FAST  # a slot freed: no waiting


async def test_a_request_waiting_for_a_busy_replica_holds_nobody_behind_it() -> None:
    """FAST (quick) has its one slot taken, SLOW (eight times slower) has room: the next request waits
    in the picker for FAST's slot; the one after it, with a request already waiting, goes to SLOW at
    once (the queue looks past the waiting one); when FAST's request ends, the waiting one goes there."""
    path, pool = path_with_model(LoadPolicy(engine_slots=1, engine_queue=0), clock=lambda: 2.0)
    for address in (FAST, SLOW):
        endpoint = pool.get(address)
        assert endpoint is not None
        record_sample(endpoint, running=0.0, waiting=0.0, kv_usage=0.1, now=2.0)
    long = InferenceRequest("POST", "/v1/completions", model="m", stream=True, max_tokens=64)
    first = path.admit(long)
    assert first.done and first.payload.picked[0] == FAST
    second = path.admit(long)
    assert not second.done and second.payload.waits_for_quicker
    third = path.admit(long)
    assert third.done and third.payload.picked[0] == SLOW
    assert not second.done
    path.finish(first.payload, EndReason.COMPLETED)
    assert second.done and second.payload.picked[0] == FAST
    assert b"picker_latency_waits_total 1.0" in path._metrics.exposition()  # once, though tried twice


def engaged_auto_path(peered: bool = False) -> tuple[RequestPath, Pool]:
    """`auto` over two alike replicas with one slot each, engaged by hand, every slot taken."""
    from picker.config.model import LoadConfig

    policy = LoadPolicy.of(LoadConfig(engine_slots=1), AffinityConfig(latency="auto"))
    path, pool = path_with_model(policy, lambda: 2.0, latency="auto", alike=True, peered=peered)
    assert path.placement.latency is not None
    path.placement.latency.refresh(2.0)
    for address in (FAST, SLOW):
        endpoint = pool.get(address)
        assert endpoint is not None
        record_sample(endpoint, running=1.0, waiting=0.0, kv_usage=0.1, now=2.0)
    path.placement.engaged = True
    return path, pool


async def test_auto_while_engaged_waits_in_the_picker_for_the_first_slot_not_on_an_engine() -> None:
    """`auto` engaged places requests as `on` does (LoadPolicy.engaged): with every engine's one
    slot taken, a request waits in the picker (one queue for the pool, bound to the first slot that
    frees) instead of queueing on an engine; not engaged, it queues on an engine as before."""
    path, _ = engaged_auto_path()
    assert not path.admit(REQUEST).done  # waits in the picker for the first slot
    path, _ = engaged_auto_path()
    path.placement.engaged = False
    assert path.admit(REQUEST).done  # not engaged: queued on an engine


async def test_auto_engaged_keeps_the_engine_queue_where_slots_free_late_or_with_peers() -> None:
    """A data plane hiding its responses' ends (the books free slots a scrape late), or peers (each
    judges `engaged` alone: one holding requests back beside one filling each freed slot starves):
    the engine queue, as not engaged."""
    from picker.streams.ends import Ends

    path, _ = engaged_auto_path()
    path.data_planes.note("envoy-1", Ends.ENGINE)
    assert path.admit(REQUEST).done
    path.data_planes.note("envoy-1", Ends.OBSERVER)  # it reports ends after all: held again
    assert not path.admit(REQUEST).done
    path, _ = engaged_auto_path(peered=True)
    assert path.admit(REQUEST).done
