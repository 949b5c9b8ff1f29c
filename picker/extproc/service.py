"""The ExternalProcessor service: one session object per ext_proc stream.

A stream in observability mode is the observer filter's (picker/extproc/observer.py); any other is the
routing filter's (picker/extproc/routing.py), whatever body modes the gateway configured.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

from picker.contract import Outcome, headers, reply_for
from picker.extproc import translate
from picker.extproc.observer import ObserverSession
from picker.extproc.routing import Pending, RoutingOptions, RoutingSession, Tokenize
from picker.request.hints import HintRules
from picker.request.pipeline import RequestPath
from picker.streams import EndReason, RequestRecord
from picker.streams.ends import Ends

log = logging.getLogger(__name__)


class ResponseEnd(enum.Enum):
    """Who reports a response's end when the routing filter does not see response bodies."""

    # an observer filter once one has attached, else Envoy's access log once an entry has come,
    # else the engine's gauges
    AUTO = "auto"
    # an observer filter (the routing stream ends at its answer); a request none claims is released
    # after the grace
    OBSERVER = "observer"
    # Envoy's access log ends every request (the lean shape), from the first request on: under
    # `auto` the requests routed before any entry came (all long streams, say) go to the engines
    ACCESS_LOG = "access-log"
    ENGINE = "engine"  # no observer in this shape: the engine's scraped gauges end requests


_MIB = 1024 * 1024


_PEERS_KEPT = 256


def _remember(peers: set[str], peer: str | None) -> None:
    """Learn a data plane connection; reconnects must not grow the set without bound."""
    if peer is None:
        return
    if len(peers) >= _PEERS_KEPT and peer not in peers:
        peers.clear()
    peers.add(peer)


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    """Routes requests for Envoy's ext_proc filter and tracks their responses."""

    def __init__(
        self,
        path: RequestPath,
        *,
        max_body_bytes: int,
        observer_attach_grace_s: float,
        queue_wait_s: float = 60.0,
        max_hint_bytes: int = 256,
        test_hooks: bool = False,
        response_end: ResponseEnd = ResponseEnd.AUTO,
        fallbacks: str = "auto",
        max_model_bytes: int | None = None,
        session_header: str | None = None,
        slo_headers: bool = False,
    ) -> None:
        self.path = path
        self.max_body_bytes = max_body_bytes
        self.queue_wait_s = queue_wait_s  # asked of Envoy while queued; <= its max_message_timeout
        self._routing = RoutingOptions(
            max_body_bytes,
            HintRules(max_hint_bytes, test_hooks, session_header, slo_headers),
            max_model_bytes,
        )
        self._fallbacks = fallbacks
        self._grace_s = observer_attach_grace_s
        self._response_end = response_end
        self._timers: set[asyncio.TimerHandle] = set()
        self.open_streams = 0
        self.observer_seen = False  # an observer stream has attached since start
        # Connections whose data plane reported a served endpoint (override_host's selected_host_key):
        # that data plane walks lists. Learned per connection, never picker-wide: a gateway routing
        # with ORIGINAL_DST on the same picker must keep getting a single endpoint.
        self._list_peers: set[str] = set()
        # Connections an observer stream came on: their observer reports each response's headers, so
        # the routing stream ends at its decision and response headers never wait for the picker.
        self._observer_peers: set[str] = set()
        # Connections whose routing streams carried response headers (response_header_mode SEND):
        # on the others (SKIP) a routing stream that Envoy closes ends with its response.
        self._headers_peers: set[str] = set()

    @property
    def grpc_message_limit(self) -> int:
        """The largest ext_proc message to accept: a BUFFERED body comes whole in one message.

        Twice the body limit (plus protobuf room), so a body up to that size is still read and refused
        with the contract's 413 rather than failing the RPC; Envoy's own buffer limit should not be
        larger (above it Envoy answers 413 itself: config/envoy.yaml maps that to the contract's body).
        """
        return 2 * self.max_body_bytes + _MIB

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        session: RoutingSession | ObserverSession | None = None
        # Read while the call is live: grpc.aio crashes the process (SIGSEGV) on context.peer() once
        # the RPC has been cancelled, e.g. in the `finally` below after the client went away.
        peer = context.peer() if context is not None else None
        self.open_streams += 1
        envoy_closed = False  # the stream ended from Envoy's side, not by the picker's return
        try:
            async for request in request_iterator:
                if session is None:
                    if request.observability_mode:
                        self.observer_seen = True
                        _remember(self._observer_peers, peer)
                        self._learn(peer, Ends.OBSERVER)
                        session = ObserverSession(self.path)
                    else:
                        session = RoutingSession(
                            self.path,
                            self._routing,
                            self._lists_ok(context, peer),
                            ends_at_decision=self._observer_reports(peer),
                        )
                if isinstance(session, ObserverSession):
                    try:
                        session.handle(request)
                    except Exception:
                        log.exception("observer message failed; ending the observer stream")
                        return
                    if session.finished:
                        return  # see below: the picker ends the RPC, not Envoy
                    continue
                try:
                    steps = session.handle(request)
                except Exception:
                    log.exception("ext_proc message failed; answering 500")
                    if session.record is None:
                        yield translate.immediate_response(
                            self.path.reject(reply_for(Outcome.INTERNAL_ERROR))
                        )
                    return
                while steps:
                    step = steps.pop(0)
                    if isinstance(step, Tokenize):
                        steps = [*await session.tokenized(step), *steps]
                    elif isinstance(step, Pending):
                        # FULL_DUPLEX request bodies have no message timeout to extend (nor a shim).
                        if session.extends_timeouts:
                            yield translate.extend_timeout(self.queue_wait_s)
                        for response in await session.wait(step):
                            yield response
                    else:
                        yield step
                if session.finished:
                    # Nothing more to decide or echo: end the RPC ourselves. Envoy then carries on
                    # without the picker, so a picker crash or restart cannot reset this stream.
                    return
            envoy_closed = True
        finally:
            self.open_streams -= 1
            if isinstance(session, RoutingSession):
                if session.record is not None and session.record.served:
                    _remember(self._list_peers, peer)
                if session.saw_response_headers:
                    _remember(self._headers_peers, peer)
                unreported = session.close()
                if session.modes.sees_response_bodies:
                    self._learn(peer, Ends.BODY)
                if unreported is not None and session.shim:
                    # no response phase will come, nor an observer: the engine's gauges say when
                    # it ended (picker/request/pipeline.py `hand_to_engine`)
                    self._learn(peer, Ends.ENGINE)
                    self.path.hand_to_engine(unreported)
                elif unreported is not None and envoy_closed and self._skips_responses(peer, unreported):
                    self._learn(peer, Ends.ACCESS_LOG if self.path.access_log_seen else Ends.STREAM_CLOSE)
                    self.response_over(unreported)
                elif unreported is not None:
                    self.expect_observer(unreported, peer)
            elif session is not None:
                session.close()

    def _lists_ok(self, context: grpc.aio.ServicerContext | None, peer: str | None) -> bool:
        """Whether this stream's data plane can use a fallback list (see scheduling.fallbacks)."""
        if self._fallbacks != "auto":
            return self._fallbacks == "always"
        if peer is not None and peer in self._list_peers:
            return True
        metadata = context.invocation_metadata() if context is not None else None
        return any(
            key == headers.DATA_PLANE and value == headers.OVERRIDE_HOST for key, value in metadata or ()
        )

    def _skips_responses(self, peer: str | None, record: RequestRecord) -> bool:
        """Whether Envoy kept this routing stream open through the response and closed it at the
        response's end: response headers SKIP (kgateway's shape), so none has ever come on this
        gRPC connection, and no observer reports them either."""
        if self._response_end not in (ResponseEnd.AUTO, ResponseEnd.ACCESS_LOG):
            return False
        if record.response_started_at is not None or record.observed or peer is None:
            return False
        return peer not in self._headers_peers and peer not in self._observer_peers

    def response_over(self, record: RequestRecord) -> None:
        """The routing stream's end was the response's end. Envoy's access log can say how it ended
        (the request is dated now, its reason the log's); without one nobody here saw, and the
        request ends now as `unobserved`. Either way its time is exact: drain records follow it to
        the millisecond."""
        if self.path.access_log_seen or self._response_end is ResponseEnd.ACCESS_LOG:
            self.path.await_access_log(record, closed=True)
        else:
            self.path.finish(record, EndReason.UNOBSERVED)

    def _observer_reports(self, peer: str | None) -> bool:
        """Whether this stream's response headers reach the picker through an observer stream: an
        observer stream has come on the same gRPC connection (the same Envoy worker's filter chain)."""
        if self._routing.test_hooks:
            return False  # the served-endpoint test header is set on the routing stream's answer
        if self._response_end not in (ResponseEnd.AUTO, ResponseEnd.OBSERVER):
            return False
        return peer is not None and peer in self._observer_peers

    def _learn(self, peer: str | None, mode: Ends) -> None:
        """What a connection showed of its responses' ends: logged when it is news."""
        if not self.path.data_planes.note(peer, mode):
            return
        if mode.blind:
            log.warning(
                "data plane %s shows the picker no response end (no observer, no response body, no "
                "access log): its requests count on a replica until the engine's gauges can show them, "
                "and end when those drop (one scrape interval behind); add the observer filter or "
                "Envoy's gRPC access log for exact counts",
                peer,
            )
        else:
            log.info("data plane %s reports response ends by %s", peer, mode.value)

    def _blind(self, peer: str | None, record: RequestRecord) -> bool:
        """Whether nothing on this connection can report this response's end: its response started
        (on the routing stream, which then ended) and neither an observer nor the access log has
        ever reported here. Its engine's gauges take it over at once; should an observer claim it
        after all (the first requests of a connection), the observer takes it back."""
        if self._response_end not in (ResponseEnd.AUTO, ResponseEnd.ENGINE) or not self.path.engine_gauges:
            return False  # no scraping: a hand-over would release it at once, before its observer came
        if self._response_end is ResponseEnd.AUTO and (self.observer_seen or self.path.access_log_seen):
            return False
        return record.response_started_at is not None and peer not in self._observer_peers

    def expect_observer(self, record: RequestRecord, peer: str | None = None) -> None:
        """Give the observer stream a grace period to claim a routed request, else settle who ends it.

        The observer's stream opens as soon as Envoy acts on the routing answer, so a request none
        claims in time whose response did not start (as far as the routing stream saw, or could
        see: it may have ended at its answer) was left by its client before Envoy got that far.
        On a connection where nothing reports ends, the engine's gauges count it meanwhile: held
        by the picker's own count for the grace, a busy pool's books would run seconds ahead.
        """
        handed = self._blind(peer, record)
        if handed:
            self.path.hand_to_engine(record)

        def expire() -> None:
            self._timers.discard(handle)
            if handed and not record.observed and peer not in self._observer_peers:
                self._learn(peer, Ends.ENGINE)  # confirmed: no observer came (said once the grace is over)
            if record.ended or record.observed:
                return
            if record.response_started_at is None:
                # The routing stream ended before any response: the client left while the request
                # was being routed or connected (Envoy never got as far as tagging it for the logs).
                self.path.finish(record, EndReason.CLIENT_DISCONNECT)
                return
            if self._response_end is ResponseEnd.OBSERVER or (
                self._response_end is ResponseEnd.AUTO and self.observer_seen
            ):
                log.warning("no observer stream for request_id=%s; releasing its slot", record.request_id)
                self.path.finish(record, EndReason.UNOBSERVED)
                return
            if self._response_end is ResponseEnd.ACCESS_LOG or (
                self._response_end is ResponseEnd.AUTO and self.path.access_log_seen
            ):
                # No observer filter, but Envoy's access log reports every request's end (and who
                # cut it): the lean shape, no per-chunk cost (docs, "Benchmarks").
                self._learn(peer, Ends.ACCESS_LOG)
                self.path.await_access_log(record)
                return
            # No filter will see this response end: the engine's own gauges say when it did.
            self._learn(peer, Ends.ENGINE)
            self.path.hand_to_engine(record)

        handle = asyncio.get_running_loop().call_later(self._grace_s, expire)
        self._timers.add(handle)

    def cancel_timers(self) -> None:
        for handle in self._timers:
            handle.cancel()
        self._timers.clear()
