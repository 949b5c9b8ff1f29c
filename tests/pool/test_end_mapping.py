"""Every request end reason reaches a draining endpoint's record as one of the pool's end categories."""

from __future__ import annotations

import pytest

from picker.contract import Outcome
from picker.observability.metrics import Metrics
from picker.pool import DrainEnd, EndpointState, Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.request.tracking import drain_end
from picker.streams import EndReason

EXPECTED = {
    EndReason.COMPLETED: DrainEnd.COMPLETED,
    EndReason.CLIENT_DISCONNECT: DrainEnd.CLIENT_DISCONNECT,
    EndReason.UPSTREAM_TRUNCATED: DrainEnd.CUT,
    EndReason.UPSTREAM_ERROR_EVENT: DrainEnd.UPSTREAM_ERROR,
    EndReason.UPSTREAM_ERROR_STATUS: DrainEnd.UPSTREAM_ERROR,
    EndReason.STALLED: DrainEnd.CUT,
    EndReason.SHUTDOWN_CUT: DrainEnd.CUT,
    EndReason.REJECTED: DrainEnd.UNKNOWN,
    EndReason.UNOBSERVED: DrainEnd.UNKNOWN,
}


@pytest.mark.parametrize("reason", list(EndReason))
def test_every_end_reason_is_mapped(reason: EndReason) -> None:
    assert drain_end(reason) is EXPECTED[reason]


@pytest.mark.parametrize("reason", list(EndReason))
def test_end_reason_lands_in_the_drain_record(reason: EndReason) -> None:
    pool, metrics = Pool(), Metrics(pool="default")
    metrics.register_pool(pool)
    pool.apply(ready=["10.0.0.1:8000"])
    path = RequestPath(pool, metrics, fallback_count=0)
    ticket = path.admit(InferenceRequest("POST", "/v1/completions", model="m", stream=True))
    assert ticket.outcome is Outcome.DISPATCHED
    record = ticket.payload
    path.response_started(record, 200, "10.0.0.1:8000")
    pool.set_state("10.0.0.1:8000", EndpointState.DRAINING)  # the drain starts mid-stream
    path.finish(record, reason)
    path.finish(record, EndReason.COMPLETED)  # a second end changes nothing
    drain = pool.get("10.0.0.1:8000").drain  # type: ignore[union-attr]
    assert (
        drain is not None and dict(drain.ends) == {EXPECTED[reason]: 1} and drain.time_to_zero_s is not None
    )
