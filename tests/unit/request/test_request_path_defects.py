"""Defects found by reading the request path (issue 21), each reproduced here first."""

from __future__ import annotations

import asyncio

import pytest

from picker.contract import Outcome
from picker.flow import FlowLimits
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.streams import EndReason

REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)


def full_pool(*addresses: str) -> tuple[RequestPath, Pool]:
    """A pool of ready endpoints; draining one is how a test takes its room away."""
    pool = Pool()
    pool.apply(ready=list(addresses))
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=0,
        load_policy=LoadPolicy(use_metrics=False),
        flow_limits=FlowLimits(max_queued=10, ttl_s=30),
        schedule=lambda delay, fn: lambda: None,
    )
    pool.on_change(path.capacity_changed)  # as picker/app.py wires it
    return path, pool


async def test_a_request_released_in_the_turn_its_client_leaves_is_not_left_in_flight() -> None:
    path, pool = full_pool("a:1")
    first = path.admit(REQUEST)
    assert first.outcome is Outcome.DISPATCHED
    # make the pool refuse a second request: the only endpoint drains, so the next one queues
    pool.drain("a:1")
    queued = path.admit(REQUEST)
    assert not queued.done

    async def client() -> None:
        await queued.wait()

    waiter = asyncio.create_task(client())
    await asyncio.sleep(0)  # the client waits on its ticket
    pool.undrain("a:1")  # capacity: the queue releases the request (its future resolves) ...
    assert queued.outcome is Outcome.DISPATCHED
    waiter.cancel()  # ... and in the same turn the client goes away, before it resumed
    with pytest.raises(asyncio.CancelledError):
        await waiter
    path.cancel(queued)  # what both frontends do when the wait is cancelled
    record = queued.payload
    assert record.ended and record.end_reason is EndReason.CLIENT_DISCONNECT
    path.finish(first.payload, EndReason.COMPLETED)
    assert path.live == 0 and pool.in_flight() == 0


async def test_a_head_limited_to_full_endpoints_does_not_block_requests_that_fit() -> None:
    path, pool = full_pool("a:1", "b:1")
    busy = path.admit(REQUEST, allowed=frozenset({"a:1"}))
    assert busy.outcome is Outcome.DISPATCHED
    pool.drain("a:1")
    pool.drain("b:1")
    head = path.admit(REQUEST, allowed=frozenset({"a:1"}))  # only a:1 will do
    behind = path.admit(REQUEST)  # any endpoint will do
    assert not head.done and not behind.done
    pool.undrain("b:1")  # b:1 has room; a:1 is still draining
    assert behind.outcome is Outcome.DISPATCHED and behind.payload.endpoint == "b:1"
    assert not head.done  # it keeps its place until a:1 can take it
    pool.undrain("a:1")
    assert head.outcome is Outcome.DISPATCHED and head.payload.endpoint == "a:1"
    for ticket in (busy, head, behind):
        path.finish(ticket.payload, EndReason.COMPLETED)
    assert path.flow.queued == 0 and pool.in_flight() == 0


def test_a_fallback_onto_an_endpoint_that_drained_after_the_pick_is_no_pick_after_the_drain() -> None:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=1, schedule=lambda delay, fn: lambda: None
    )
    record = path.admit(REQUEST).payload
    _, fallback = record.picked
    pool.drain(fallback)  # the fallback starts draining after the pick ...
    path.response_started(record, 200, fallback, streaming=True)  # ... then Envoy walks onto it
    endpoint = pool.get(fallback)
    assert endpoint is not None and endpoint.state is EndpointState.DRAINING
    assert endpoint.drain is not None and endpoint.drain.picks_after_start == 0
    assert pool.totals.picks_after_start == 0
    assert endpoint.in_flight == 1  # still counted where it runs
    path.finish(record, EndReason.COMPLETED)
    assert pool.in_flight() == 0


def test_a_fallback_picked_after_the_drain_started_still_counts() -> None:
    """The count keeps its meaning: a list handed out after the drain began names it only by fault."""
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    pool.drain("b:1")
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=1, schedule=lambda delay, fn: lambda: None
    )
    record = path.admit(REQUEST).payload
    assert record.picked == ("a:1",)  # a draining endpoint is never listed
    record.picked = ("a:1", "b:1")  # as if it had been (the defect this figure exists to catch)
    path.response_started(record, 200, "b:1", streaming=True)
    assert pool.totals.picks_after_start == 1
    path.finish(record, EndReason.COMPLETED)
