"""A minimal OTLP/gRPC trace collector on loopback: keeps every span it is sent, for tests and benches.

The OpenTelemetry SDK's OTLP exporter talks to it as to a real collector (the same
`opentelemetry.proto` service); it runs on its own threads, so blocking test code can wait on it.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root
    attributes: dict[str, object]
    events: tuple[str, ...]
    service: str


def _value(any_value: object) -> object:
    kind = any_value.WhichOneof("value")  # type: ignore[attr-defined]
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]  # type: ignore[attr-defined]
    return getattr(any_value, kind) if kind else None


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def start(self) -> Collector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    received.append(
                        ReceivedSpan(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            events=tuple(e.name for e in span.events),
                            service=str(resource.get("service.name", "")),
                        )
                    )
        with self._lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def named(self, name: str) -> list[ReceivedSpan]:
        with self._lock:
            return [span for span in self.spans if span.name == name]
