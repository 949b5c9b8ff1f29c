"""A rollback re-groups the requests still queued for the candidate (issue 40, item 7): before, a
request given the candidate group and queued kept it, and reached a candidate that was still ready
(`drain_on_rollback: false`, or a drain store that was unavailable)."""

from __future__ import annotations

from picker.config.model import RolloutConfig
from picker.contract import Outcome
from picker.flow import FlowLimits
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.pool.scrapes import record_sample
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.rollout import CANDIDATE, STABLE, Canary, CanaryPlan
from picker.scheduling import LoadPolicy
from picker.streams import EndReason

LABEL = "app.kubernetes.io/version"
OLD, NEW = "10.0.0.1:8000", "10.0.0.2:8000"
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)


async def test_a_request_queued_for_the_candidate_goes_to_stable_after_a_rollback() -> None:
    pool = Pool()
    pool.reconcile(
        {OLD: EndpointState.READY, NEW: EndpointState.READY},
        "file",
        labels={OLD: {LABEL: "v1"}, NEW: {LABEL: "v2"}},
    )
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=0,
        load_policy=LoadPolicy(engine_slots=1),
        flow_limits=FlowLimits(ttl_s=60.0),
    )
    canary = path.canary = Canary(CanaryPlan.of(RolloutConfig(candidate="v2", steps="100")), pool.now())
    for address in (OLD, NEW):  # both engines idle, one slot each, and busy by what is sent below
        record_sample(pool.get(address), 0, 0, 0.0, pool.now())  # type: ignore[arg-type]
    first = path.admit(REQUEST)
    second = path.admit(REQUEST)  # the candidate's slot and its engine queue of one
    assert first.outcome is second.outcome is Outcome.DISPATCHED
    queued = path.admit(REQUEST)
    assert not queued.done and queued.payload.group == CANDIDATE
    canary.abort(pool.now(), [])  # rolled back; the candidate is not drained (drain_on_rollback off)
    path.finish(first.payload, EndReason.COMPLETED)  # the candidate's slot frees
    assert queued.done and queued.outcome is Outcome.DISPATCHED
    assert queued.payload.group == STABLE and queued.payload.picked[0] == OLD
