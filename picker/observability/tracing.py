"""OpenTelemetry traces of the request path: one trace per request, joined to the gateway's and engine's.

Off by default (`tracing.enabled`, the reference picker's `--tracing`). On, each request gets a root
span `picker.request`, continued from the client's W3C `traceparent` when it sent one, with children:
- `picker.admission`: the door (outcome, and whether it queued);
- `picker.queue`: the wait in the admission queue, only when it waited;
- `picker.pick`: the chosen endpoint and its fallbacks;
- `picker.stream`: from the response's first byte (the commit point) to the request's end, with a
  `first_token` event, the served endpoint (a `fallback_served` event when Envoy walked the list), the
  status, the tokens and the one end reason.
The routed request carries `traceparent` naming the root span, so the replica's spans (vLLM's
`--otlp-traces-endpoint`) hang under the picker's. No prompt text is ever an attribute.

The request path calls `RequestTrace` methods at its own transitions (picker/request/pipeline.py); with
tracing off it holds no trace and calls nothing. Which exporter runs is the wiring's (picker/wiring.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from picker.contract import headers

_PROPAGATOR = TraceContextTextMapPropagator()
_SCOPE = "inference-picker"


class RequestTrace:
    """The spans of one request; each method is one transition of the request path."""

    __slots__ = ("_admission", "_queue", "_root", "_stream", "_tracer")

    def __init__(self, tracer: trace.Tracer, parent: Context | None, attributes: Mapping[str, object]):
        self._tracer = tracer
        self._root: Span = tracer.start_span(
            "picker.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=dict(attributes),  # type: ignore[arg-type]
        )
        context = trace.set_span_in_context(self._root)
        self._admission: Span | None = tracer.start_span("picker.admission", context=context)
        self._queue: Span | None = None
        self._stream: Span | None = None

    def _child(self, name: str) -> Span:
        return self._tracer.start_span(name, context=trace.set_span_in_context(self._root))

    def outgoing(self) -> tuple[tuple[str, str], ...]:
        """The headers that carry this trace to the replica (`traceparent`, `tracestate`)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self._root))
        return tuple(carrier.items())

    def queued(self) -> None:
        self._end_admission("queued", queued=True)
        self._queue = self._child("picker.queue")

    def refused(self, outcome: str) -> None:
        """Answered by the picker (status contract): the trace ends here."""
        if self._queue is not None:
            self._queue.set_attribute("picker.outcome", outcome)
            self._queue.end()
            self._queue = None
        self._end_admission(outcome, queued=False)
        self._root.set_attribute("picker.outcome", outcome)
        self._root.set_status(Status(StatusCode.ERROR, outcome))
        self._root.end()

    def picked(self, destinations: Sequence[str], started_ns: int) -> None:
        """Dispatched to `destinations` (primary first); the pick took from `started_ns` to now."""
        if self._queue is not None:
            self._queue.end()
            self._queue = None
        else:
            self._end_admission("dispatched", queued=False)
        self._root.set_attribute("picker.outcome", "dispatched")
        pick = self._tracer.start_span(
            "picker.pick", context=trace.set_span_in_context(self._root), start_time=started_ns
        )
        pick.set_attribute("picker.endpoint", destinations[0])
        pick.set_attribute("picker.fallbacks", list(destinations[1:]))
        pick.end()

    def response_started(self, status: int, served: str | None, primary: str | None) -> None:
        stream = self._stream = self._child("picker.stream")
        stream.set_attribute("http.response.status_code", status)
        if served:
            stream.set_attribute("picker.served", served)
            if primary is not None and served != primary:
                stream.add_event("fallback_served", {"picker.primary": primary, "picker.served": served})

    def first_token(self) -> None:
        if self._stream is not None:
            self._stream.add_event("first_token")

    def ended(self, reason: str, tokens: int, endpoint: str | None, resumed_on: tuple[str, ...] = ()) -> None:
        """The request's one end reason: every open span ends (a resumed stream's span says where
        it was continued)."""
        if self._stream is not None:
            self._stream.set_attribute("picker.end_reason", reason)
            self._stream.set_attribute("picker.tokens", tokens)
            self._stream.end()
            self._stream = None
        if self._queue is not None:  # the client left while it waited
            self._queue.end()
            self._queue = None
        self._end_admission(reason, queued=False)
        self._root.set_attribute("picker.end_reason", reason)
        if resumed_on:
            self._root.set_attribute("picker.resumed", len(resumed_on))
            self._root.set_attribute("picker.resumed_on", list(resumed_on))
        if endpoint:
            self._root.set_attribute("picker.endpoint", endpoint)
        if reason != "completed":
            self._root.set_status(Status(StatusCode.ERROR, reason))
        self._root.end()

    def _end_admission(self, outcome: str, *, queued: bool) -> None:
        admission = self._admission
        if admission is None:
            return
        admission.set_attribute("picker.outcome", outcome)
        admission.set_attribute("picker.queued", queued)
        admission.end()
        self._admission = None


class Tracing:
    """Starts one `RequestTrace` per request from a tracer provider (the SDK's, set up by the wiring)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self._tracer = provider.get_tracer(_SCOPE)

    def start(self, carrier: Mapping[str, str], attributes: Mapping[str, object]) -> RequestTrace:
        """A request's trace, continued from `carrier`'s `traceparent` (the client's) when valid."""
        parent = _PROPAGATOR.extract(carrier) if headers.TRACEPARENT in carrier else None
        return RequestTrace(self._tracer, parent, attributes)
