"""What a scrape teaches about an engine's batch slots: a queue beside N running says it has N; N
running with nothing waiting says it has at least N (what the `auto` switch needs to count a slot
wait on replicas whose slots were never learned)."""

from __future__ import annotations

from picker.pool.endpoint import Endpoint, EndpointState
from picker.pool.scrapes import record_sample


def test_a_queue_teaches_the_slots_and_room_without_one_teaches_a_floor() -> None:
    endpoint = Endpoint("127.0.0.1:1", EndpointState.READY, 0.0)
    record_sample(endpoint, running=8, waiting=0, kv_usage=0.2, now=1.0)
    record_sample(endpoint, running=5, waiting=0, kv_usage=0.2, now=2.0)
    assert (endpoint.learned_slots, endpoint.room_seen) == (0, 8)
    record_sample(endpoint, running=12, waiting=3, kv_usage=0.9, now=3.0)
    assert (endpoint.learned_slots, endpoint.room_seen) == (12, 8)  # a queue is no room
