"""Tracing through the real Envoy (issue 21): the client's traceparent is continued by the picker, its
spans reach an OTLP collector, and the replica receives a traceparent naming the picker's span."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.otlp_collector import Collector
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body

pytestmark = pytest.mark.envoy

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_a_request_is_one_trace_from_client_to_replica(tmp_path: Path) -> None:
    collector = Collector().start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # ms: the batch goes out quickly
        "OTEL_SERVICE_NAME": "picker-under-test",
    }
    options = StackOptions(replicas=2, picker_args=("--tracing",), picker_env=env)
    stack = Stack(tmp_path, options).start()
    try:
        traceparent = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
        with http_client.stream(
            "POST",
            f"{stack.url}/v1/completions",
            json=completion_body(5),
            headers={"traceparent": traceparent, "x-request-id": "traced-1"},
            timeout=20,
        ) as response:
            assert response.status_code == 200
            body = b"".join(response.iter_bytes())
        assert b"[DONE]" in body
        wait_until(lambda: collector.named("picker.stream"), 10, what="the picker's spans")
        (root,) = collector.named("picker.request")
        assert root.trace_id == CLIENT_TRACE and root.parent_span_id == CLIENT_SPAN
        assert root.service == "picker-under-test"
        (stream,) = collector.named("picker.stream")
        assert stream.parent_span_id == root.span_id and "first_token" in stream.events
        assert stream.attributes["picker.end_reason"] == "completed"
        seen = [e for r in stack.replicas for e in stack.sim_requests(r) if e["request_id"] == "traced-1"]
        (entry,) = seen
        assert entry["traceparent"] == f"00-{CLIENT_TRACE}-{root.span_id}-01"
        stack.wait_no_leaks()
    finally:
        stack.stop()
        collector.stop()
