"""Model servers without vLLM's metrics: once every endpoint has failed its scrapes and none has load
data, requests are picked by the picker's in-flight counts (counted, warned once) instead of queued."""

from __future__ import annotations

import logging

import pytest

from picker.pool.scrapes import record_failure
from picker.scheduling import LoadPolicy
from tests.unit.extproc.test_extproc_service import BODY, body, make, request_headers, run


async def test_picked_by_in_flight_when_no_endpoint_has_metrics(caplog: pytest.LogCaptureFixture) -> None:
    h = make(load_policy=LoadPolicy())
    for endpoint in h.pool.endpoints():
        record_failure(endpoint)
    with caplog.at_level(logging.WARNING, logger="picker.request.pipeline"):
        for _ in range(2):
            responses = await run(h.service, [request_headers(), body(BODY)])
            assert not responses[-1].HasField("immediate_response")
    assert h.value("picker_picks_without_metrics_total") == 2
    assert sum("picking by the picker's own in-flight counts" in r.getMessage() for r in caplog.records) == 1
