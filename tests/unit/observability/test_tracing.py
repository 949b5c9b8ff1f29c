"""Tracing of the request path with the OpenTelemetry SDK's in-memory exporter (issue 21): one trace per
request, continued from the client's traceparent and carried to the replica; nothing when off."""

from __future__ import annotations

import asyncio

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from picker.contract import Outcome
from picker.flow import FlowLimits
from picker.observability.metrics import Metrics
from picker.observability.tracing import Tracing
from picker.pool import Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath, Routed
from picker.streams import EndReason

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)
TOKEN = b'data: {"choices":[{"text":" t","finish_reason":null}]}\n\n'
LAST = b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


def traced(**options: object) -> tuple[RequestPath, Pool, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    path = RequestPath(
        pool,
        Metrics(pool="default"),
        fallback_count=1,
        schedule=lambda delay, fn: lambda: None,
        tracing=Tracing(provider),
        **options,  # type: ignore[arg-type]
    )
    pool.on_change(path.capacity_changed)
    return path, pool, exporter


def spans(exporter: InMemorySpanExporter) -> dict[str, object]:
    return {span.name: span for span in exporter.get_finished_spans()}


def test_one_trace_per_request_continued_from_the_client_and_carried_to_the_replica() -> None:
    path, _, exporter = traced()
    ticket = path.admit(REQUEST, trace_context={"traceparent": TRACEPARENT})
    routed = path.settle(ticket)
    assert isinstance(routed, Routed)
    record = routed.record
    path.response_started(record, 200, record.picked[1], streaming=True)  # Envoy walked to the fallback
    path.body_chunk(record, TOKEN)
    path.body_chunk(record, LAST)
    path.response_ended(record, True, EndReason.COMPLETED)
    found = spans(exporter)
    assert set(found) == {"picker.request", "picker.admission", "picker.pick", "picker.stream"}
    root = found["picker.request"]
    assert format(root.context.trace_id, "032x") == CLIENT_TRACE  # type: ignore[attr-defined]
    assert format(root.parent.span_id, "016x") == CLIENT_SPAN  # type: ignore[attr-defined]
    for name in ("picker.admission", "picker.pick", "picker.stream"):
        assert found[name].parent.span_id == root.context.span_id  # type: ignore[attr-defined]
    stream = found["picker.stream"]
    assert [e.name for e in stream.events] == ["fallback_served", "first_token"]  # type: ignore[attr-defined]
    assert stream.attributes["picker.end_reason"] == "completed"  # type: ignore[attr-defined]
    assert found["picker.pick"].attributes["picker.endpoint"] == record.picked[0]  # type: ignore[attr-defined]
    ((name, value),) = routed.headers
    assert name == "traceparent"
    assert value == f"00-{CLIENT_TRACE}-{format(root.context.span_id, '016x')}-01"  # type: ignore[attr-defined]
    for span in found.values():  # ids, names and counts only: never the prompt
        assert "hi" not in str(dict(span.attributes or {}))  # type: ignore[attr-defined]


async def test_a_queued_request_gets_a_queue_span() -> None:
    path, pool, exporter = traced(flow_limits=FlowLimits(ttl_s=5))
    pool.drain("a:1")
    pool.drain("b:1")
    ticket = path.admit(REQUEST)
    assert not ticket.done
    pool.undrain("a:1")
    await asyncio.wait_for(ticket.wait(), 1)
    routed = path.settle(ticket)
    assert isinstance(routed, Routed)
    path.finish(routed.record, EndReason.CLIENT_DISCONNECT)
    found = spans(exporter)
    assert {"picker.queue", "picker.pick"} <= set(found)
    assert found["picker.admission"].attributes["picker.queued"] is True  # type: ignore[attr-defined]
    assert found["picker.request"].status.is_ok is False  # type: ignore[attr-defined]


def test_a_refused_request_ends_its_trace_with_the_outcome() -> None:
    path, pool, exporter = traced(flow_limits=FlowLimits(max_queued=0))
    pool.drain("a:1")
    pool.drain("b:1")
    ticket = path.admit(REQUEST)
    assert ticket.outcome is Outcome.REJECTED_SATURATED
    path.settle(ticket)
    root = spans(exporter)["picker.request"]
    assert root.attributes["picker.outcome"] == "rejected-saturated"  # type: ignore[attr-defined]


def test_without_tracing_no_trace_and_no_header() -> None:
    pool = Pool()
    pool.apply(ready=["a:1"])
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=0, schedule=lambda delay, fn: lambda: None
    )
    routed = path.settle(path.admit(REQUEST, trace_context={"traceparent": TRACEPARENT}))
    assert isinstance(routed, Routed)
    assert routed.record.trace is None and routed.headers == ()


def test_an_otlp_exporter_that_cannot_load_is_one_line_at_start(monkeypatch) -> None:
    """xds-protos ships older OTel protos in the same files; installed last, the exporter cannot load.
    The picker says so in one line (and how to fix it) instead of dying on a traceback."""
    import sys

    import pytest

    from picker.config.model import PickerConfig, TracingConfig
    from picker.wiring import StartupProblem, start_tracing

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.grpc.trace_exporter", None)
    config = PickerConfig(tracing=TracingConfig(enabled=True, exporter="otlp"))
    with pytest.raises(StartupProblem, match=r"tracing\.exporter: otlp cannot load.*opentelemetry-proto"):
        start_tracing(config)
