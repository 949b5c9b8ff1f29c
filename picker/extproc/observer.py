"""The observability-mode stream: sees the response body go by, and its end, without holding it.

An observer configured without streamed response bodies (`response_body_mode: NONE`, read from the
stream's protocol_config) costs nothing per chunk: the request's end comes from Envoy's access log
(or, without one, the engine's gauges), not from this stream. It loses what only the
body tells: token counts, TTFT and inter-token histograms, error events and vLLM's silent
`finish_reason: "abort"` truncation (docs, "Benchmarks").
"""

from __future__ import annotations

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from picker.contract import headers
from picker.extproc import translate
from picker.request.pipeline import RequestPath
from picker.streams import RequestRecord


class ObserverSession:
    """Joins the routed request by the picker's request id, then reports its response."""

    __slots__ = ("_bodies", "_ended", "_path", "record")

    @property
    def finished(self) -> bool:
        """Nothing more to see on this stream: the RPC may end (see ExtProcService.Process)."""
        return self._ended

    def __init__(self, path: RequestPath) -> None:
        self._path = path
        self.record: RequestRecord | None = None
        self._ended = False
        self._bodies = True  # this filter streams response bodies past the picker

    def handle(self, request: ep.ProcessingRequest) -> None:
        kind = request.WhichOneof("request")
        if kind == "response_body":  # the hot path: once per chunk of every stream
            record = self.record
            if record is None or self._ended:
                return
            body = request.response_body
            self._path.body_chunk(record, body.body)
            if body.end_of_stream:
                self._end(True)
            return
        if kind == "request_headers":
            if request.HasField("protocol_config"):
                # STREAMED or FULL_DUPLEX only: Envoy 1.40 sends an observer no body at all in the
                # BUFFERED modes (measured), just as in NONE
                self._bodies = translate.modes(request).sees_response_bodies
            request_id = translate.header_value(request.request_headers, headers.PICKER_REQUEST_ID)
            self.record = self._path.attach_observer(request_id) if request_id else None
            self._ended = self.record is None  # not a request the picker routed: nothing to see
            return
        record = self.record
        if record is None or self._ended:
            return
        if kind == "response_headers":
            response = translate.header_map(request.response_headers)
            status = int(response.get(headers.STATUS, "0") or 0)
            streaming = response.get(headers.CONTENT_TYPE, "").startswith("text/event-stream")
            self._path.response_started(record, status, translate.served_endpoint(request), streaming)
            if request.response_headers.end_of_stream:
                self._end(True)
            elif not self._bodies:
                # Envoy ends this stream now: the access log (else the engine's gauges) ends the request
                self._ended = True
                self._path.observer_blind(record)
        elif kind == "response_trailers":
            self._end(True)

    def _end(self, end_of_stream: bool) -> None:
        if self.record is not None and not self._ended:
            self._ended = True
            self._path.observer_ended(self.record, end_of_stream)

    def close(self) -> None:
        # Stopping without the response's end of stream: the client or the model server went away.
        self._end(False)
