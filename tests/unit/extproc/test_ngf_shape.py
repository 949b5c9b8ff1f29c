"""The routing filter asked the way NGINX Gateway Fabric's shim asks (issue 21), in process: headers
without pseudo-headers or protocol_config, the whole body, half-close, no response phase."""

from __future__ import annotations

import json

from loadtest.ngf_client import request_messages
from picker.contract import headers
from picker.pool.scrapes import record_sample
from tests.unit.extproc.test_extproc_service import make, run

BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()


def destination(response: object) -> str | None:
    mutation = response.request_headers.response.header_mutation  # type: ignore[attr-defined]
    for option in mutation.set_headers:
        if option.header.key == headers.DESTINATION:
            return option.header.raw_value.decode()  # type: ignore[no-any-return]
    return None


async def test_the_headers_answer_waits_for_the_body_and_carries_one_endpoint() -> None:
    h = make(service_options={"fallbacks": "auto"})
    responses = await run(h.service, list(request_messages(BODY)))
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds[0] == "request_headers" and "override_message_timeout" not in kinds
    chosen = destination(responses[0])
    assert chosen in {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}  # one member, no list
    assert kinds == ["request_headers", "request_body"]


async def test_a_bad_body_is_refused_with_an_immediate_response() -> None:
    h = make(service_options={"fallbacks": "auto"})
    responses = await run(h.service, list(request_messages(b"not json")))
    (only,) = responses
    assert only.WhichOneof("response") == "immediate_response"
    assert only.immediate_response.status.code == 400


async def test_a_drained_endpoint_is_never_chosen() -> None:
    h = make(service_options={"fallbacks": "auto"})
    h.pool.drain("10.0.0.1:8000")
    h.pool.drain("10.0.0.2:8000")
    for _ in range(10):
        responses = await run(h.service, list(request_messages(BODY)))
        assert destination(responses[0]) == "10.0.0.3:8000"


async def test_with_no_response_phase_the_engines_gauges_end_each_request() -> None:
    h = make(grace=0.01, service_options={"fallbacks": "auto"})
    responses = await run(h.service, list(request_messages(BODY)))
    chosen = destination(responses[0])
    assert h.path.live == 1  # routed, and nobody will report its response
    record = next(iter(h.path._live.values()))
    assert record.engine_tracked  # handed to the engine's gauges at once, not after a grace
    endpoint = h.pool.get(chosen)  # type: ignore[arg-type]
    assert endpoint is not None
    record_sample(endpoint, running=0, waiting=0, kv_usage=0.0, now=h.pool.now() + 1)  # the engine is idle
    h.path.capacity_changed()
    assert h.path.live == 0 and h.pool.in_flight() == 0
