"""The ExternalProcessor service: one session object per ext_proc stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from picker import headers
from picker.contract import Outcome, Reply, reply_for
from picker.extproc import translate
from picker.flow import Ticket
from picker.inference import parse_request
from picker.pipeline import RequestPath
from picker.streams import EndReason, RequestRecord

log = logging.getLogger(__name__)


def _priority(value: str | None) -> int | None:
    if value is None or not value.strip():
        return 0
    try:
        return int(value)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class _Pending:
    """The request is queued: Envoy must be told to wait before the answer comes."""

    ticket: Ticket[RequestRecord]
    phase: str


class _RoutingSession:
    """The routing filter's stream: decide, then learn who served.

    With the shipped config (response bodies NONE) the observer stream reports how the response
    ended and this RPC ends at the response headers. If the routing filter is configured with
    response_body_mode STREAMED instead, this session tracks the body itself.
    """

    def __init__(self, service: ExtProcService) -> None:
        self._service = service
        self._path = service.path
        self._headers: dict[str, str] = {}
        self._body = bytearray()
        self.record: RequestRecord | None = None
        self.sees_bodies = False
        self._body_ended = False

    def handle(self, request: ep.ProcessingRequest) -> ep.ProcessingResponse | _Pending | None:
        match request.WhichOneof("request"):
            case "request_headers":
                self._headers = translate.header_map(request.request_headers)
                self.sees_bodies = translate.streams_response_bodies(request)
                if request.request_headers.end_of_stream:
                    return self._decide("request_headers")
                return translate.continue_response("request_headers")
            case "request_body":
                self._body += request.request_body.body
                if len(self._body) > self._service.max_body_bytes:
                    return self._decide("request_body")
                if request.request_body.end_of_stream:
                    return self._decide("request_body")
                return translate.continue_response("request_body")
            case "request_trailers":
                return translate.continue_response("request_trailers")
            case "response_headers":
                if self.record is not None:
                    response = translate.header_map(request.response_headers)
                    status = int(response.get(headers.STATUS, "0") or 0)
                    streaming = response.get(headers.CONTENT_TYPE, "").startswith("text/event-stream")
                    self._path.response_started(
                        self.record, status, translate.served_endpoint(request), streaming
                    )
                    if self.sees_bodies:
                        self.record.observed = True  # this stream reports the end, not an observer
                return translate.continue_response("response_headers")
            case "response_body":
                if self.sees_bodies and self.record is not None and not self._body_ended:
                    self._path.body_chunk(self.record, request.response_body.body)
                    if request.response_body.end_of_stream:
                        self._body_ended = True
                        self._path.observer_ended(self.record, True)
                return translate.continue_response("response_body")
            case "response_trailers":
                return translate.continue_response("response_trailers")
            case other:
                log.warning("unexpected ext_proc message kind=%s", other)
                return None

    def _decide(self, phase: str) -> ep.ProcessingResponse | _Pending:
        parsed = parse_request(
            self._headers.get(headers.METHOD, "POST"),
            self._headers.get(headers.PATH, "/"),
            self._headers.get(headers.CONTENT_TYPE),
            bytes(self._body),
            self._service.max_body_bytes,
        )
        self._body = bytearray()
        if isinstance(parsed, Reply):
            return translate.immediate_response(self._path.reject(parsed))
        priority = _priority(self._headers.get(headers.PRIORITY))
        if priority is None:
            return translate.immediate_response(
                self._path.reject(
                    reply_for(Outcome.BAD_REQUEST, f"header {headers.PRIORITY} must be an integer")
                )
            )
        ticket = self._path.admit(parsed, flow=self._headers.get(headers.FAIRNESS_ID, ""), priority=priority)
        if ticket.done:
            return self._answer(ticket, phase)
        return _Pending(ticket, phase)

    async def wait(self, pending: _Pending) -> ep.ProcessingResponse:
        """Wait in the admission queue; a cancelled stream (client gone) gives up its place."""
        try:
            await pending.ticket.wait()
        except asyncio.CancelledError:
            self._path.cancel(pending.ticket)
            raise
        return self._answer(pending.ticket, pending.phase)

    def _answer(self, ticket: Ticket[RequestRecord], phase: str) -> ep.ProcessingResponse:
        decision = self._path.settle(ticket)
        if isinstance(decision, Reply):
            return translate.immediate_response(decision)
        self.record = decision.record
        return translate.route_response(phase, decision.destinations, decision.record.request_id)

    def close(self) -> None:
        record = self.record
        if record is None or record.ended:
            return
        if self.sees_bodies:
            if not self._body_ended:
                self._body_ended = True
                self._path.observer_ended(record, False)
        elif not record.observed:
            self._service.expect_observer(record)


class _ObserverSession:
    """The observability-mode stream: sees the response body go by, and its end."""

    def __init__(self, service: ExtProcService) -> None:
        self._path = service.path
        self.record: RequestRecord | None = None
        self._ended = False

    def handle(self, request: ep.ProcessingRequest) -> None:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            request_id = translate.header_map(request.request_headers).get(headers.PICKER_REQUEST_ID)
            self.record = self._path.attach_observer(request_id) if request_id else None
            return
        record = self.record
        if record is None or self._ended:
            return
        match kind:
            case "response_body":
                body = request.response_body
                self._path.body_chunk(record, body.body)
                if body.end_of_stream:
                    self._end(True)
            case "response_headers":
                response = translate.header_map(request.response_headers)
                status = int(response.get(headers.STATUS, "0") or 0)
                streaming = response.get(headers.CONTENT_TYPE, "").startswith("text/event-stream")
                self._path.response_started(record, status, translate.served_endpoint(request), streaming)
                if request.response_headers.end_of_stream:
                    self._end(True)
            case "response_trailers":
                self._end(True)
            case _:
                pass

    def _end(self, end_of_stream: bool) -> None:
        if self.record is not None and not self._ended:
            self._ended = True
            self._path.observer_ended(self.record, end_of_stream)

    def close(self) -> None:
        # Stopping without the response's end of stream: the client or the model server went away.
        self._end(False)


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    """Routes requests for Envoy's ext_proc filter and tracks their responses."""

    def __init__(
        self,
        path: RequestPath,
        *,
        max_body_bytes: int,
        observer_attach_grace_s: float,
        queue_wait_s: float = 60.0,
    ) -> None:
        self.path = path
        self.max_body_bytes = max_body_bytes
        self.queue_wait_s = queue_wait_s  # asked of Envoy while queued; <= its max_message_timeout
        self._grace_s = observer_attach_grace_s
        self._timers: set[asyncio.TimerHandle] = set()
        self.open_streams = 0

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        session: _RoutingSession | _ObserverSession | None = None
        self.open_streams += 1
        try:
            async for request in request_iterator:
                if session is None:
                    session = _ObserverSession(self) if request.observability_mode else _RoutingSession(self)
                try:
                    response = session.handle(request)
                except Exception:
                    log.exception("ext_proc message failed; answering 500")
                    if isinstance(session, _RoutingSession) and session.record is None:
                        yield translate.immediate_response(
                            self.path.reject(reply_for(Outcome.INTERNAL_ERROR))
                        )
                    return
                if isinstance(response, _Pending):
                    yield translate.extend_timeout(self.queue_wait_s)
                    response = await session.wait(response)  # type: ignore[union-attr]
                if response is not None:
                    yield response
                if (
                    request.HasField("response_headers")
                    and isinstance(session, _RoutingSession)
                    and not session.sees_bodies
                ):
                    # Nothing more to decide for this request: end the RPC ourselves. Envoy then
                    # carries on without the picker, so a picker crash or restart cannot reset
                    # this stream (an open ext_proc stream that errors takes the request with it).
                    return
        finally:
            self.open_streams -= 1
            if session is not None:
                session.close()

    def expect_observer(self, record: RequestRecord) -> None:
        """Give the observer stream a grace period to claim a routed request, else end it here."""

        def expire() -> None:
            self._timers.discard(handle)
            if record.ended or record.observed:
                return
            if record.response_started_at is None:
                # The routing stream ended before any response: the client left while the request
                # was being routed or connected (Envoy never got as far as tagging it for the logs).
                self.path.finish(record, EndReason.CLIENT_DISCONNECT)
                return
            log.warning("no observer stream for request_id=%s; releasing its slot", record.request_id)
            self.path.finish(record, EndReason.UNOBSERVED)

        handle = asyncio.get_running_loop().call_later(self._grace_s, expire)
        self._timers.add(handle)

    def cancel_timers(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
