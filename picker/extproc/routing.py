"""The routing filter's ext_proc stream: decide once per request, in whatever body mode Envoy uses.

One code path for every request body mode (the mode comes from `protocol_config` on the first
message; Envoy 1.40 sends it on every stream). What each mode allows, measured on Envoy 1.40:
- BUFFERED / BUFFERED_PARTIAL: the whole (or first) body comes in one message and is decided there,
  even when `end_of_stream` is false because HTTP/2 trailers follow. An empty body followed by
  trailers sends no body message: only `request_trailer_mode: SEND` lets the picker see (and refuse)
  it, so the shipped config sends trailers.
- FULL_DUPLEX_STREAMED: the headers answer is held until the body's end, then sent with the pick,
  followed by the body echoed back (Envoy forwards only what the picker returns). A body followed
  by trailers is refused (400): Envoy forwards such an echoed body twice.
- STREAMED (with or without `send_body_without_waiting_for_header_response`), or request body NONE:
  decided on the headers alone (model unknown, body unchecked). Holding the headers answer works for
  plain bodies, but with trailers Envoy duplicates the body, or waits for answers the picker cannot
  give yet (504).
- No `protocol_config` and no pseudo-headers: not Envoy but a shim that sends the whole body without
  waiting and reads only the headers answer (NGINX Gateway Fabric, loadtest/ngf_client.py). The
  headers answer is held until the body's end and carries the pick, as the reference picker answers;
  no response phase will ever come, so the request's end is left to the engine's gauges.
Response bodies (STREAMED or FULL_DUPLEX on this filter) are tracked here, with the same SSE path
the observer filter uses; FULL_DUPLEX chunks are echoed back at once.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from picker.contract import Outcome, Reply, headers, reply_for
from picker.extproc import translate
from picker.flow import Ticket
from picker.pool import DrainEnd
from picker.request.hints import HintRules, Hints, read_hints
from picker.request.inference import InferenceRequest, parse_request
from picker.request.pipeline import RequestPath
from picker.streams import RequestRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RoutingOptions:
    max_body_bytes: int
    hints: HintRules = field(default_factory=HintRules)  # how hint headers are read (requests.*, affinity.*)
    max_model_bytes: int | None = None  # model name length bound (config: requests.*)

    @property
    def test_hooks(self) -> bool:
        return self.hints.test_hooks


@dataclass(frozen=True, slots=True)
class Pending:
    """The request is queued: Envoy must be told to wait before the answer comes."""

    ticket: Ticket[RequestRecord]
    phase: str


@dataclass(frozen=True, slots=True)
class Tokenize:
    """Precise prefix affinity: the request's token ids come from an engine before it is admitted."""

    parsed: InferenceRequest
    hints: Hints
    phase: str


Step = ep.ProcessingResponse | Pending | Tokenize


def _eos(request: ep.ProcessingRequest) -> bool | None:
    message = getattr(request, request.WhichOneof("request") or "request_headers")
    return getattr(message, "end_of_stream", None)


class RoutingSession:
    """One request as the routing filter sees it: decide, then learn who served (and how it ended)."""

    def __init__(
        self,
        path: RequestPath,
        options: RoutingOptions,
        fallbacks: bool = True,
        *,
        ends_at_decision: bool = False,
    ) -> None:
        self._path = path
        self._options = options
        self._fallbacks = fallbacks  # the data plane walks a list (override_host); else one endpoint
        # an observer stream reports the response: end this stream once the request side is answered
        self._ends_at_decision = ends_at_decision
        self.modes = translate.Modes()
        self._headers: dict[str, str] = {}
        self._hint: tuple[str, ...] | None = None
        self._connection: str | None = None  # the HTTP/1.x client connection (picker/pool/connections.py)
        self._chunks: list[bytes] = []  # body messages held until the decision
        self._size = 0
        self._trailers = False  # request trailers arrived before the decision
        self._decided = False
        self._request_ended = False  # the body's end of stream went back to Envoy (FULL_DUPLEX)
        self.record: RequestRecord | None = None
        self._response_ended = False
        self.finished = False  # nothing more to do on this stream: the RPC may end
        # a data plane that is not Envoy (no protocol_config, no pseudo-headers): it sends the body
        # without waiting, reads only the headers answer and never sends a response phase
        self.shim = False
        self.saw_response_headers = False  # this data plane sends the routing filter response headers

    @property
    def _holds_headers(self) -> bool:
        """Whether the headers answer waits for the body's end."""
        return self.modes.holds_request_headers or self.shim

    @property
    def extends_timeouts(self) -> bool:
        """Whether Envoy's message timeout applies while queued (FULL_DUPLEX bodies and shims: no)."""
        return self.modes.request_body != translate.FULL_DUPLEX and not self.shim

    def handle(self, request: ep.ProcessingRequest) -> list[Step]:
        kind = request.WhichOneof("request")
        if request.HasField("protocol_config"):  # on the stream's first message, whichever it is
            self.modes = translate.modes(request)
        if kind and kind.startswith("request") and log.isEnabledFor(logging.DEBUG):
            log.debug("ext_proc %s eos=%s modes=%s", kind, _eos(request), self.modes)
        match kind:
            case "request_headers":
                return self._on_request_headers(request)
            case "request_body":
                return self._on_request_body(request.request_body)
            case "request_trailers":
                return self._on_request_trailers()
            case "response_headers":
                return self._on_response_headers(request)
            case "response_body":
                return self._on_response_body(request.response_body)
            case "response_trailers":
                self._end_response(True)
                return [translate.continue_response("response_trailers")]
            case other:
                log.warning("unexpected ext_proc message kind=%s", other)
                return []

    # --- request side -------------------------------------------------------------------------

    def _on_request_headers(self, request: ep.ProcessingRequest) -> list[Step]:
        self._headers = translate.header_map(request.request_headers)
        self._hint = translate.subset_hint(request)
        if self._path.peering is not None:  # one picker sees every end in order: nothing to learn
            self._connection = translate.client_connection(request)
        # Envoy always sends :method and :path (and protocol_config since 1.3x); a shim sends neither
        self.shim = not self.modes.known and headers.PATH not in self._headers
        mode = self.modes.request_body
        hints = self._hints()
        if isinstance(hints, Reply):  # refused on the headers alone: no need to wait for the body
            return self._refuse(hints)
        if request.request_headers.end_of_stream:
            return self._decide("request_headers")
        if mode in (translate.NONE, translate.STREAMED):
            return self._decide("request_headers", headers_only=True)
        if self._holds_headers:
            return []
        return [translate.continue_response("request_headers")]

    def _on_request_body(self, body: ep.HttpBody) -> list[Step]:
        if self._decided:  # decided on the headers alone: the body goes by
            if self.modes.request_body != translate.FULL_DUPLEX:
                return [translate.continue_response("request_body")]
            if self._request_ended:
                # Envoy may deliver the last chunk twice (envoyproxy/envoy#46237): never echo it twice
                return []
            self._request_ended = body.end_of_stream
            return [translate.streamed_body("request_body", body.body, body.end_of_stream)]
        self._chunks.append(body.body)
        self._size += len(body.body)
        mode = self.modes.request_body
        if (
            self._size > self._options.max_body_bytes
            or body.end_of_stream
            or (self.modes.known and mode in (translate.BUFFERED, translate.BUFFERED_PARTIAL))
        ):
            # BUFFERED sends the whole body in one message; end_of_stream=false only means that
            # trailers follow (which, with request_trailer_mode SKIP, the picker never sees).
            partial = mode == translate.BUFFERED_PARTIAL and not body.end_of_stream
            return self._decide("request_body", partial=partial)
        if self._holds_headers:
            return []
        return [translate.continue_response("request_body")]

    def _on_request_trailers(self) -> list[Step]:
        """Trailers end the request (request_trailer_mode SEND): the last chance to decide it."""
        self._trailers = True
        if self._decided:
            return [translate.continue_response("request_trailers")]
        if self._chunks and self.modes.request_body == translate.FULL_DUPLEX:
            # Envoy 1.40 forwards a FULL_DUPLEX body echoed before request trailers twice
            # (measured): refuse rather than send the model server a corrupt body.
            return self._refuse(
                reply_for(
                    Outcome.BAD_REQUEST, "request trailers are not supported by this gateway's body mode"
                )
            )
        return self._decide("request_trailers")

    def _refuse(self, reply: Reply) -> list[Step]:
        self._decided = self.finished = True
        return [translate.immediate_response(self._path.reject(reply))]

    def _parse(self, headers_only: bool, partial: bool) -> InferenceRequest | Reply:
        method = self._headers.get(headers.METHOD, "POST")
        path = self._headers.get(headers.PATH, "/")
        if headers_only:
            return InferenceRequest(method=method, path=path)
        body = b"".join(self._chunks)
        parsed = parse_request(
            method,
            path,
            self._headers.get(headers.CONTENT_TYPE),
            body,
            self._options.max_body_bytes,
            self._options.max_model_bytes,
        )
        if partial and isinstance(parsed, Reply) and parsed.outcome is Outcome.BAD_REQUEST:
            # BUFFERED_PARTIAL stopped at Envoy's buffer: the body is larger than the picker can read.
            return reply_for(
                Outcome.TOO_LARGE, f"request body exceeds the {len(body)} bytes Envoy buffers for the picker"
            )
        return parsed

    def _hints(self) -> Hints | Reply:
        """The client's scheduling hints and the allowed endpoints, or the contract reply refusing them."""
        return read_hints(
            self._headers.get, self._options.hints, self._path.objectives, self._path.eligible, self._hint
        )

    def _decide(self, phase: str, *, headers_only: bool = False, partial: bool = False) -> list[Step]:
        self._decided = True
        parsed = self._parse(headers_only, partial)
        if isinstance(parsed, Reply):
            return self._refuse(parsed)
        hints = self._hints()  # again: endpoints may have drained while the body arrived
        if isinstance(hints, Reply):
            return self._refuse(hints)
        if self._path.wants_tokens(parsed):
            return [Tokenize(parsed, hints, phase)]
        return self._admit(parsed, hints, phase, None)

    async def tokenized(self, step: Tokenize) -> list[Step]:
        """Get the token ids (precise affinity), then admit as `_decide` would have."""
        return self._admit(step.parsed, step.hints, step.phase, await self._path.tokens(step.parsed))

    def _admit(
        self, parsed: InferenceRequest, hints: Hints, phase: str, tokens: list[int] | None
    ) -> list[Step]:
        ticket = self._path.admit(
            parsed,
            flow=hints.flow,
            priority=hints.priority,
            allowed=hints.allowed,
            fallbacks=self._fallbacks,
            trace_context=hints.trace_context,
            session=hints.session,
            tokens=tokens,
            connection=self._connection,
            slo=hints.slo,
        )
        if ticket.done:
            return list(self._answer(ticket, phase))
        return [Pending(ticket, phase)]

    async def wait(self, pending: Pending) -> list[ep.ProcessingResponse]:
        """Wait in the admission queue; a cancelled stream (client gone) gives up its place."""
        try:
            await pending.ticket.wait()
        except asyncio.CancelledError:
            self._path.cancel(pending.ticket)
            raise
        return self._answer(pending.ticket, pending.phase)

    def _answer(self, ticket: Ticket[RequestRecord], phase: str) -> list[ep.ProcessingResponse]:
        decision = self._path.settle(ticket)
        if isinstance(decision, Reply):
            self.finished = True
            return [translate.immediate_response(decision)]
        record = self.record = decision.record
        if self.modes.sees_response_bodies:
            record.observed = True  # this stream reports the end, not an observer
        held = self._holds_headers and phase != "request_headers"
        if record.prefill_on is not None and not held and phase == "request_trailers":
            # a trailers answer cannot set a header: no prefill replica can be named, the
            # destination computes the prompt (its hand-off given up before it began)
            self._path.recomputed(record, None, DrainEnd.UNKNOWN)
        route = translate.route_response(
            "request_headers" if held else phase,
            decision.destinations,
            record.request_id,
            remove=headers.CLIENT_HINTS if record.prefill_on else headers.CLIENT_ROUTING,
            extra=decision.headers,
        )
        out = [route, *self._release_held()] if held else [route]
        if self.shim:
            self.finished = True  # it reads nothing after this and will report no response
        elif self._ends_at_decision and not self.modes.sees_response_bodies and self._request_answered():
            # Envoy goes on without this stream once the picker ends it: the response headers then
            # pass without a round trip to the picker (a hop less from the replica's headers to
            # the client's), the observer reports who served, and a picker that stops
            # answering cannot hold a response (tests/envoy/test_routing.py).
            self.finished = True
        return out

    def _request_answered(self) -> bool:
        """Nothing Envoy sent on the request side still waits for an answer or an echo."""
        return self.modes.request_body != translate.FULL_DUPLEX or self._request_ended

    def _release_held(self) -> list[ep.ProcessingResponse]:
        """The body (and trailers) Envoy sent while the headers answer was held, answered in order."""
        out: list[ep.ProcessingResponse] = []
        if self.modes.request_body == translate.FULL_DUPLEX:
            # echoed in the chunks Envoy sent (each within its message limits), the last one ending it
            last = len(self._chunks) - 1
            self._request_ended = True
            out.extend(
                translate.streamed_body("request_body", chunk, i == last and not self._trailers)
                for i, chunk in enumerate(self._chunks)
            )
        else:
            out.extend(translate.continue_response("request_body") for _ in self._chunks)
        if self._trailers:
            out.append(translate.continue_response("request_trailers"))
        self._chunks = []
        return out

    # --- response side ------------------------------------------------------------------------

    def _on_response_headers(self, request: ep.ProcessingRequest) -> list[Step]:
        self.saw_response_headers = True
        record = self.record
        extra: list[tuple[str, str]] = []
        if record is not None:
            response = translate.header_map(request.response_headers)
            status = int(response.get(headers.STATUS, "0") or 0)
            streaming = response.get(headers.CONTENT_TYPE, "").startswith("text/event-stream")
            served = translate.served_endpoint(request)
            self._path.response_started(record, status, served, streaming)
            if self._options.test_hooks:
                extra.append(
                    (headers.TEST_SERVED_ENDPOINT, served or (record.picked[0] if record.picked else ""))
                )
        if not self.modes.sees_response_bodies:
            self.finished = True  # nothing more to decide: Envoy carries on without the picker
        elif request.response_headers.end_of_stream:
            self._end_response(True)
        return [translate.response_headers_answer(extra)]

    def _on_response_body(self, body: ep.HttpBody) -> list[Step]:
        record = self.record
        if record is not None and not self._response_ended:
            self._path.body_chunk(record, body.body)
        if body.end_of_stream:
            self._end_response(True)
        if self.modes.response_body == translate.FULL_DUPLEX:
            return [translate.streamed_body("response_body", body.body, body.end_of_stream)]
        return [translate.continue_response("response_body")]

    def _end_response(self, end_of_stream: bool) -> None:
        if self._response_ended:
            return
        self._response_ended = True
        self.finished = True
        if self.record is not None and self.modes.sees_response_bodies:
            self._path.observer_ended(self.record, end_of_stream)

    def close(self) -> RequestRecord | None:
        """The stream is over. Returns a routed record whose end nobody reported yet (the service
        hands it to the observer, or to the engine's gauges)."""
        record = self.record
        if record is None or record.ended:
            return None
        if self.modes.sees_response_bodies:
            self._end_response(False)
            return None
        return None if record.observed else record
