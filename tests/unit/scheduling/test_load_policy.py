import random
from dataclasses import dataclass

from picker.pool import Endpoint, EndpointState
from picker.pool.load import LoadSample
from picker.pool.scrapes import record_failure, record_sample
from picker.scheduling import LoadPolicy, estimated_load, estimated_waiting, pick, saturated
from picker.scheduling.load import busy

POLICY = LoadPolicy(staleness_s=2.0, waiting_threshold=1, kv_threshold=0.9)


def endpoint(address: str = "a:1", in_flight: int = 0) -> Endpoint:
    return Endpoint(address, EndpointState.READY, 0.0, in_flight=in_flight)


def test_missing_or_stale_metrics_count_as_saturated() -> None:
    e = endpoint()
    assert saturated(e, 10.0, POLICY)
    record_sample(e, running=0, waiting=0, kv_usage=0.0, now=10.0)
    assert not saturated(e, 11.0, POLICY)
    assert saturated(e, 12.5, POLICY)


def test_failed_scrape_forgets_the_load() -> None:
    e = endpoint()
    record_sample(e, 1, 0, 0.1, now=0.0)
    record_failure(e)
    assert e.load is None and e.scrape_failures == 1 and saturated(e, 0.0, POLICY)


def test_queue_or_kv_over_threshold_saturates() -> None:
    e = endpoint()
    record_sample(e, 2, 1, 0.1, now=0.0)
    assert saturated(e, 0.0, POLICY)
    record_sample(e, 2, 0, 0.95, now=0.0)
    assert saturated(e, 0.0, POLICY)


def send(e: Endpoint, n: int) -> None:
    e.in_flight += n
    e.arrivals += n


def end(e: Endpoint, n: int) -> None:
    e.in_flight -= n
    e.departures += n


def test_between_scrapes_what_the_picker_sent_and_saw_end_moves_the_estimate() -> None:
    e = endpoint()
    send(e, 2)
    record_sample(e, running=2, waiting=0, kv_usage=0.1, now=0.0)
    policy = LoadPolicy(engine_slots=3)
    assert estimated_waiting(e, policy) == 0
    send(e, 3)  # three sent since the scrape: one slot left, then two queue
    assert estimated_load(e) == 5 and estimated_waiting(e, policy) == 2
    end(e, 4)  # four ended since: room again
    assert estimated_waiting(e, policy) == 0


def test_scrape_window_errs_on_the_busy_side() -> None:
    e = endpoint()
    before = e.arrivals
    send(e, 1)  # sent while the scrape was in the air: the engine may or may not have counted it
    record_sample(e, running=1, waiting=0, kv_usage=0.0, now=0.0, arrivals_before=before)
    assert estimated_load(e) == 2  # counted twice rather than not at all


def test_slots_are_learned_from_a_scrape_with_a_queue() -> None:
    e = endpoint()
    send(e, 4)
    record_sample(e, running=2, waiting=2, kv_usage=0.1, now=0.0)
    assert e.learned_slots == 2
    end(e, 2)  # two ended since: the queue drained into the freed slots
    assert estimated_waiting(e, LoadPolicy()) == 0


@dataclass
class Cand:
    address: str
    in_flight: int = 0
    load: LoadSample | None = None
    peer_in_flight: int = 0
    learned_slots: int = 0
    arrivals: int = 0
    peer_arrivals: int = 0
    departures: int = 0
    superseded: int = 0


def test_pick_prefers_the_least_loaded_and_needs_one_with_room() -> None:
    busy = Cand("busy", 3, LoadSample(3, 0, 0.5, 0.0, 0, 0))
    idle = Cand("idle", 0, LoadSample(0, 0, 0.0, 0.0, 0, 0))
    full = Cand("full", 1, LoadSample(1, 4, 0.2, 0.0, 0, 0))
    assert pick([busy, idle, full], 3, random.Random(0), 0.0, POLICY) == ["idle", "busy", "full"]
    assert pick([full], 3, random.Random(0), 0.0, POLICY) == []


def test_without_metrics_pick_is_least_in_flight() -> None:
    assert pick([Cand("a", 2), Cand("b", 1)], 1, random.Random(0)) == ["b"]


def test_the_books_gap_is_what_the_books_count_beyond_the_engine_and_what_is_on_its_way() -> None:
    from picker.pool.scrapes import record_sample
    from picker.scheduling.load import books_gap

    endpoint = Endpoint("10.0.0.1:8000", EndpointState.READY, 0.0, in_flight=3, arrivals=5, departures=2)
    assert books_gap(endpoint) == 0.0  # no scrape yet: nothing to compare
    record_sample(endpoint, running=3, waiting=0, kv_usage=0.0, now=1.0)
    assert books_gap(endpoint) == 0.0  # every end seen: the books are the engine's
    endpoint.in_flight, endpoint.arrivals = 4, 6  # one more sent after the scrape was: on its way
    assert books_gap(endpoint) == 0.0
    record_sample(endpoint, running=2, waiting=1, kv_usage=0.0, now=2.0)  # one ended, unseen here
    assert books_gap(endpoint) == 1.0


def test_with_an_engine_queue_bound_a_request_waits_in_the_picker_not_on_the_engine() -> None:
    """`engine_queue` (affinity.latency_engine_queue, 0 by default with the latency model): with the
    slots known, an engine is saturated once one more request would wait there beyond the bound."""
    e = endpoint()
    send(e, 2)
    record_sample(e, running=2, waiting=0, kv_usage=0.1, now=0.0)
    late = LoadPolicy(engine_slots=3, engine_queue=0)
    assert not saturated(e, 0.0, late)  # a slot is free
    send(e, 1)
    assert saturated(e, 0.0, late)  # every slot taken: one more would wait on the engine
    assert not saturated(e, 0.0, LoadPolicy(engine_slots=3))  # the default lets one wait there
    assert not saturated(e, 0.0, LoadPolicy(engine_slots=3, engine_queue=1))
    send(e, 1)
    assert saturated(e, 0.0, LoadPolicy(engine_slots=3, engine_queue=1))
    unknown = endpoint()  # slots neither configured nor learned: the scrape's queue decides
    record_sample(unknown, running=5, waiting=0, kv_usage=0.1, now=0.0)
    assert not saturated(unknown, 0.0, LoadPolicy(engine_queue=0))


def test_busy_is_saturated_by_its_slots_alone() -> None:
    """A replica whose every slot is taken frees one when a request ends; one with stale figures or a
    full KV cache is no replica to wait for."""
    policy = LoadPolicy(engine_slots=2, engine_queue=0)
    e = endpoint()
    send(e, 2)
    record_sample(e, running=2, waiting=0, kv_usage=0.1, now=0.0)
    assert busy(e, 0.0, policy)
    assert not busy(e, 5.0, policy)  # stale: saturated, but not known to be busy
    record_sample(e, running=2, waiting=0, kv_usage=0.95, now=0.0)
    assert not busy(e, 0.0, policy)  # its cache is full
    end(e, 1)
    record_sample(e, running=1, waiting=0, kv_usage=0.1, now=0.0)
    assert not busy(e, 0.0, policy)  # it has room
