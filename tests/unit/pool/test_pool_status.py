"""The pool's health as the InferencePool shows it (picker/pool/status.py): every phase, every reason."""

from __future__ import annotations

from picker.contract.pool_status import CONDITION_STATUS, STATE_EVENT, PoolReason, PoolState
from picker.pool.endpoint import Endpoint, EndpointState
from picker.pool.status import Phase, pool_health

R, D, N, G = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY, EndpointState.GONE


def endpoints(*states: EndpointState) -> list[Endpoint]:
    return [Endpoint(f"10.0.0.{i}:8000", state, 0.0) for i, state in enumerate(states)]


def reason(*states: EndpointState, phase: Phase = Phase.SERVING, problem: str | None = None) -> PoolReason:
    return pool_health(endpoints(*states), phase, problem).reason


def test_each_reading_of_a_serving_picker() -> None:
    assert reason(R, D, N) is PoolReason.READY
    assert reason(D, D, G) is PoolReason.ALL_DRAINING  # the gone one is not listed
    assert reason(D, N) is PoolReason.NO_READY_ENDPOINTS
    assert reason() is PoolReason.NO_READY_ENDPOINTS
    assert reason(G) is PoolReason.NO_READY_ENDPOINTS
    assert reason(R, problem="InferencePool default/vllm not found") is PoolReason.SOURCE_UNAVAILABLE


def test_the_phase_comes_first_and_every_reason_has_a_status() -> None:
    assert reason(R, phase=Phase.STOPPING) is PoolReason.STOPPING
    assert [p.name for p in Phase] == ["SERVING", "STOPPING"]  # the writer starts serving: no dead state
    seen = set()
    for phase in Phase:
        for states in ((R,), (D,), (N,), ()):
            for problem in (None, "broken"):
                health = pool_health(endpoints(*states), phase, problem)
                assert health.status in ("True", "False")
                assert health.reason.value[0].isupper() and health.message
                seen.add(health.reason)
    assert seen == set(PoolReason)
    assert set(CONDITION_STATUS) == set(PoolState)
    assert set(STATE_EVENT) == set(PoolState)


def test_the_message_counts_what_it_read() -> None:
    health = pool_health(endpoints(R, D, N, G), Phase.SERVING)
    assert (health.ready, health.draining, health.listed) == (1, 1, 3)
    assert health.status == "True" and health.message == "1 of 3 endpoints ready, 1 draining"
    assert pool_health(endpoints(D), Phase.SERVING).status == "False"
