"""Shapes that hide a response's end (issue 45): response headers only, no observer, no access log,
and NGINX Gateway Fabric's shim. There the engines' gauges are the truth for what a replica holds:
the picker's own count of a request lasts only until a scrape can show it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from loadtest.ngf_client import request_messages
from loadtest.procs import async_wait_until
from picker.contract import headers
from picker.flow import FlowLimits
from picker.pool.scrapes import record_sample
from picker.scheduling import LoadPolicy
from picker.scheduling.load import estimated_load
from picker.streams import EndReason
from picker.streams.ends import DataPlanes, Ends
from tests.unit.extproc.test_extproc_modes import first
from tests.unit.extproc.test_extproc_service import BODY, Peer, body, make, request_headers, response_headers

A = "10.0.0.1:8000"
ENVOY = "ipv4:127.0.0.1:40001"  # one gRPC connection from a data plane
LONG_GRACE = 60.0  # an observer grace no test waits out: what happens, happens before it


async def route(h: object, peer: str = ENVOY) -> list[object]:
    """One request through a routing stream that sees response headers and nothing after them."""
    messages = [first(), body(BODY), response_headers(200, A)]
    return [r async for r in h.service.Process(_feed(messages), Peer(peer))]  # type: ignore[attr-defined]


async def _feed(messages: list[object]):  # type: ignore[no-untyped-def]
    for message in messages:
        yield message


async def test_a_blind_connection_hands_each_request_to_the_engine_at_once_not_after_the_grace() -> None:
    h = make([A], grace=LONG_GRACE)
    await route(h)
    (record,) = h.path._live.values()
    assert record.engine_tracked  # its engine's gauges settle it from the next scrape on
    endpoint = h.pool.get(A)
    assert endpoint is not None
    record_sample(endpoint, 0, 0, 0.0, h.pool.now() + 1, sent_at=h.pool.now() + 0.5)  # engine idle
    h.path.capacity_changed()
    assert h.path.live == 0 and endpoint.in_flight == 0
    assert h.value("picker_request_ends_total", reason=EndReason.UNOBSERVED.value) == 1


async def test_a_queued_request_goes_as_soon_as_a_scrape_shows_the_slot_free() -> None:
    """The failure measured at 55 requests/s: ended requests held their slots for the observer grace
    while the picker's queue grew and the engines idled."""
    h = make(
        [A],
        grace=LONG_GRACE,
        load_policy=LoadPolicy(engine_slots=1),
        flow_limits=FlowLimits(ttl_s=60.0),
    )
    endpoint = h.pool.get(A)
    assert endpoint is not None
    record_sample(endpoint, 0, 0, 0.0, h.pool.now())
    await route(h)  # takes the one slot
    await route(h)  # and the engine's queue of one
    second = asyncio.create_task(_collect(h, [first(), body(BODY)]))
    await async_wait_until(lambda: h.path.flow.queued == 1, 5, what="the third request to wait")
    now = h.pool.now()
    record_sample(endpoint, 0, 0, 0.0, now + 0.2, sent_at=now + 0.1)  # both have ended
    h.path.capacity_changed()
    assert h.path.flow.queued == 0  # dispatched on that scrape
    answers = await asyncio.wait_for(second, 5)
    assert answers[-1].HasField("request_body")  # routed: its body goes on to the engine


async def test_an_observer_that_claims_a_handed_request_takes_it_back_from_the_gauges() -> None:
    h = make([A], grace=LONG_GRACE)
    await route(h)
    (record,) = h.path._live.values()
    assert record.engine_tracked
    observer = [request_headers({headers.PICKER_REQUEST_ID: record.request_id}, observer=True)]
    await _run_until_claimed(h, observer)
    assert not record.engine_tracked and h.path._engine_tracked == 0
    endpoint = h.pool.get(A)
    assert endpoint is not None
    record_sample(endpoint, 0, 0, 0.0, h.pool.now() + 1, sent_at=h.pool.now() + 0.5)
    h.path.capacity_changed()
    assert h.path.live == 1  # its observer reports its end: a gauge does not end it


async def _collect(h: object, messages: list[object]) -> list[Any]:
    return [r async for r in h.service.Process(_feed(messages), Peer(ENVOY))]  # type: ignore[attr-defined]


async def _run_until_claimed(h: object, messages: list[object]) -> None:
    async for _ in h.service.Process(_feed(messages), Peer(ENVOY)):  # type: ignore[attr-defined]
        pass


async def test_a_request_still_in_transit_is_not_ended_by_a_scrape_that_cannot_show_it() -> None:
    """The shim's client gets its endpoint, then opens its own connection to it: a scrape sent
    meanwhile shows the engine without it. Only requests sent before the transit window count as
    the engine's to end."""
    h = make([A], grace=0.01, service_options={"fallbacks": "auto"}, engine_transit_s=0.05)
    await _shim(h)
    (early,) = h.path._live.values()
    await _shim(h)
    late = next(r for r in h.path._live.values() if r is not early)
    endpoint = h.pool.get(A)
    assert endpoint is not None and early.lease is not None and late.lease is not None
    # the scrape was sent 10 ms after the second request: the engine had neither (the first ended)
    sent = late.lease.picked_at + 0.01
    early.lease._picked_at = sent - 1.0  # type: ignore[attr-defined]  # long before
    record_sample(endpoint, 0, 0, 0.0, sent + 0.01, sent_at=sent)
    h.path.capacity_changed()
    assert early.ended and not late.ended
    assert endpoint.in_flight == 1 and estimated_load(endpoint) == 1.0
    record_sample(endpoint, 0, 0, 0.0, sent + 0.2, sent_at=sent + 0.1)  # past its window: ended
    h.path.capacity_changed()
    assert late.ended and endpoint.in_flight == 0


async def _shim(h: object) -> None:
    async for _ in h.service.Process(_feed(list(request_messages(BODY))), None):  # type: ignore[attr-defined]
        pass


async def test_each_connection_says_how_it_sees_ends_in_the_admin_view_and_the_metric() -> None:
    h = make([A], grace=0.05)
    await route(h, "ipv4:127.0.0.1:1")  # nobody claims it: confirmed blind once the grace is over
    await route(h, ENVOY)
    second = list(h.path._live.values())[-1]
    # an observer comes on ENVOY's connection within the grace, as in the shipped config
    await _run_until_claimed(
        h, [request_headers({headers.PICKER_REQUEST_ID: second.request_id}, observer=True)]
    )
    await async_wait_until(lambda: len(h.path.data_planes.summary()) == 2, 5, what="both connections known")
    assert h.path.data_planes.summary() == {"ipv4:127.0.0.1:1": "engine", ENVOY: "observer"}
    assert h.value("picker_data_plane_connections", ends="engine") == 1
    assert h.value("picker_data_plane_connections", ends="observer") == 1


def test_data_planes_are_bounded_and_report_news_only() -> None:
    planes = DataPlanes(kept=2)
    assert planes.note("a", Ends.ENGINE) and not planes.note("a", Ends.ENGINE)
    assert planes.note("a", Ends.OBSERVER)  # a change is news
    planes.note("b", Ends.BODY)
    planes.note("c", Ends.ACCESS_LOG)
    assert list(planes.summary()) == ["b", "c"] and planes.mode("a") is None
    assert not planes.note(None, Ends.ENGINE)
    assert not planes.blind()  # the scraper keeps its usual interval
    planes.note("d", Ends.ENGINE)
    assert planes.blind()  # a connection hides ends: the scraper runs at load.blind_scrape_interval_s


async def test_a_request_still_waiting_for_its_headers_is_not_taken_for_one_on_the_engine() -> None:
    """A burst keeps requests in Envoy's hands longer than the transit window: one routed long before
    the scrape, its response not started, is not on the engine yet, and must not make the scrape end
    a request that is (a clean-clone CI run of 1,100 held streams lost some that way)."""
    h = make([A], grace=LONG_GRACE)
    await route(h)  # answered and handed to the engine: it runs there
    (running,) = h.path._live.values()
    waiting = await asyncio.create_task(_collect_until_routed(h))  # routed, no response headers yet
    endpoint = h.pool.get(A)
    assert endpoint is not None and waiting.lease is not None and running.lease is not None
    waiting.lease._picked_at -= 5.0  # type: ignore[attr-defined]  # long before the scrape
    now = h.pool.now()
    record_sample(endpoint, 1, 0, 0.0, now + 0.2, sent_at=now + 0.1)  # the engine holds the one
    h.path.capacity_changed()
    assert not running.ended and not waiting.ended


async def _collect_until_routed(h: Any) -> Any:
    before = set(h.path._live)
    await _collect(h, [first(), body(BODY)])  # the routing stream ends before any response phase
    (record,) = [r for k, r in h.path._live.items() if k not in before]
    return record


async def test_without_scraping_a_request_waits_for_its_observer_as_before() -> None:
    """No gauges to hand it to (--no-scrape): an early hand-over would release the request at once,
    before its observer came (a clean-clone CI run: one stream ended `unobserved`, another lost)."""
    h = make([A], grace=LONG_GRACE, engine_gauges=False)
    await route(h)
    (record,) = h.path._live.values()
    assert not record.ended and not record.engine_tracked
    observer = [request_headers({headers.PICKER_REQUEST_ID: record.request_id}, observer=True)]
    await _run_until_claimed(h, observer)
    assert record.observed and not record.ended
