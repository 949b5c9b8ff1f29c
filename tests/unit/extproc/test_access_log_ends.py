"""The lean shapes: no filter streams response bodies past the picker, Envoy's access log ends each
request (issue 15: zero per-chunk cost while each stream's end, and who cut it, stays known)."""

from __future__ import annotations

import time
from collections.abc import Callable

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from loadtest.procs import async_wait_until
from picker.contract import headers
from picker.extproc.service import ResponseEnd
from picker.pool.scrapes import record_sample
from picker.streams import Attempts, EndReason
from tests.unit.extproc.test_extproc_service import BODY, make, request_headers, response_headers, routed, run

A = "10.0.0.1:8000"
_MODE = processing_mode_pb2.ProcessingMode
DOWNSTREAM = Attempts(flags=frozenset({"downstream_remote_reset"}), status=200)
UPSTREAM = Attempts(flags=frozenset({"upstream_remote_reset"}), status=200)


def _headers_only_observer(request_id: str) -> ep.ProcessingRequest:
    """An observer filter configured without response bodies (response_body_mode NONE)."""
    message = request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True)
    message.protocol_config.request_body_mode = _MODE.NONE
    message.protocol_config.response_body_mode = _MODE.NONE
    return message


async def _routed_without_observer(grace: float, **path_options: object) -> tuple[object, str]:
    h = make(endpoints=(A,), grace=grace, **path_options)
    h.path.access_logged("warm-up", Attempts())  # Envoy's access log has spoken: it is configured
    route = await run(h.service, [request_headers(), body_message(), response_headers(200, A)])
    return h, routed(route[:2])[1]


def body_message() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=BODY, end_of_stream=True))


async def test_without_observer_a_long_stream_waits_for_its_access_log_entry() -> None:
    h, request_id = await _routed_without_observer(grace=0.01)
    record = h.path._live[request_id]  # type: ignore[attr-defined]
    await async_wait_until(lambda: record.observer_done, 2, what="the grace to hand the end to the log")
    assert not record.engine_tracked  # the log will say when, and why: not the engine's gauges
    h.path.capacity_changed()  # type: ignore[attr-defined]
    assert h.path.live == 1  # type: ignore[attr-defined]
    h.path.access_logged(request_id, Attempts(status=200))  # type: ignore[attr-defined]
    assert h.path.live == 0 and h.pool.in_flight() == 0  # type: ignore[attr-defined]
    assert h.value("picker_request_ends_total", reason=EndReason.COMPLETED.value) == 1  # type: ignore[attr-defined]


async def test_lean_shape_stated_in_config_waits_for_the_log_before_any_entry_came() -> None:
    """`--response-end access-log`: the first requests (say 10,000 long streams opened at once, none
    ended yet) are the log's to end too; under `auto` they would go to the engines' gauges."""
    h = make(endpoints=(A,), grace=0.01, service_options={"response_end": ResponseEnd.ACCESS_LOG})
    route = await run(h.service, [request_headers(), body_message(), response_headers(200, A)])
    request_id = routed(route[:2])[1]
    record = h.path._live[request_id]
    assert not h.path.access_log_seen
    await async_wait_until(lambda: record.observer_done, 2, what="the grace to hand the end to the log")
    assert not record.engine_tracked
    record_sample(h.pool.get(A), 0, 0, 0.0, time.monotonic())  # an idle-looking engine ends nothing
    h.path.capacity_changed()
    assert h.path.live == 1
    h.path.access_logged(request_id, Attempts(status=200))
    assert h.path.live == 0 and h.pool.in_flight() == 0
    assert h.value("picker_request_ends_total", reason=EndReason.COMPLETED.value) == 1


async def test_without_observer_the_log_tells_disconnect_from_truncation() -> None:
    for attempts, reason in (
        (DOWNSTREAM, EndReason.CLIENT_DISCONNECT),
        (UPSTREAM, EndReason.UPSTREAM_TRUNCATED),
    ):
        h, request_id = await _routed_without_observer(grace=0.01)
        await async_wait_until(
            lambda h=h, i=request_id: h.path._live[i].observer_done,  # type: ignore[attr-defined]
            2,
            what="the hand-over to the log",
        )
        h.path.access_logged(request_id, attempts)  # type: ignore[attr-defined]
        assert h.path.live == 0  # type: ignore[attr-defined]
        assert h.value("picker_request_ends_total", reason=reason.value) == 1  # type: ignore[attr-defined]


def _at_once(delay: float, fn: Callable[[], None]) -> Callable[[], None]:
    """Timers fire at once: a grace the implementation wrongly starts ends the request right away."""
    fn()
    return lambda: None


async def test_a_headers_only_observer_leaves_the_end_to_the_log() -> None:
    h = make(endpoints=(A,), grace=30, schedule=_at_once)
    h.path.access_logged("warm-up", Attempts())
    route = await run(h.service, [request_headers(), body_message(), response_headers(200, A)])
    request_id = routed(route[:2])[1]
    # Envoy ends this stream right after the response headers: that is not the response's end
    await run(h.service, [_headers_only_observer(request_id), response_headers(200, A, observer=True)])
    assert h.path.live == 1
    h.path.access_logged(request_id, DOWNSTREAM)
    assert h.path.live == 0
    assert h.value("picker_request_ends_total", reason=EndReason.CLIENT_DISCONNECT.value) == 1
    assert h.value("picker_request_ends_total", reason=EndReason.UNOBSERVED.value) == 0


async def test_a_lost_log_entry_is_backstopped_by_the_engine_not_by_silence() -> None:
    now = [100.0]
    h = make(endpoints=(A,), grace=30, clock=lambda: now[0], stall_after_s=30.0)
    h.path.access_logged("warm-up", Attempts())
    route = await run(h.service, [request_headers(), body_message(), response_headers(200, A)])
    request_id = routed(route[:2])[1]
    await run(h.service, [_headers_only_observer(request_id), response_headers(200, A, observer=True)])
    record = h.path._live[request_id]
    now[0] += 29.0
    h.path.sweep_stalls()
    assert not record.engine_tracked and not record.stalled
    now[0] += 2.0  # past the stall bound without its entry: the engine's gauges may end it now
    h.path.sweep_stalls()
    assert record.engine_tracked and not record.stalled and h.path.live == 1
    endpoint = h.pool.get(A)
    assert endpoint is not None
    record_sample(endpoint, running=1, waiting=0, kv_usage=0.1, now=now[0] + 1)
    h.path.capacity_changed()
    assert h.path.live == 1  # the engine still runs it: kept
    record_sample(endpoint, running=0, waiting=0, kv_usage=0.0, now=now[0] + 2)
    h.path.capacity_changed()
    assert h.path.live == 0 and h.pool.in_flight() == 0
