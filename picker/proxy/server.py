"""The proxy's frontend: one `serve()` per request, wire format in (downstream.py), core calls out.

Admission, picking, tracking and the end reason all happen in the core (`RequestPath`); this module
reads the request, waits in the queue when told to, streams the upstream response chunk by chunk
(awaiting each client write before the next upstream read: a slow client slows its upstream, memory
stays bounded) and tells the core how the response ended. HTTP/1.1 and h2c share all of it.
"""

from __future__ import annotations

import asyncio
import logging
import random

from aiohttp import web

from picker.contract import Outcome, Reply, headers, reply_for
from picker.pool import Pool
from picker.proxy import translate
from picker.proxy.downstream import Downstream, Http1Downstream
from picker.proxy.exchange import Exchange, UpstreamCut
from picker.proxy.pd_steps import PdSteps
from picker.proxy.resuming import prepared, read_ask, relay_resumable
from picker.proxy.upstream import UPSTREAM_READ_ERRORS, Opened, Upstream, UpstreamUnavailable
from picker.request.hints import HintRules, read_hints
from picker.request.inference import parse_request
from picker.request.pipeline import RequestPath
from picker.streams import EndReason, RequestRecord
from picker.streams.resume import ResumeMode, Why

log = logging.getLogger(__name__)

_READ_SIZE = 64 * 1024
_MODELS = "/v1/models"
_CLIENT_GONE = (ConnectionError,)  # what a write raises once the client went away


class ProxyFrontend:
    def __init__(
        self,
        path: RequestPath,
        pool: Pool,
        upstream: Upstream,
        *,
        max_body_bytes: int,
        max_hint_bytes: int = 256,
        max_model_bytes: int | None = None,
        test_hooks: bool = False,
        session_header: str | None = None,
        slo_headers: bool = False,
        resume: ResumeMode = ResumeMode.OFF,
        resume_max: int = 2,
        resume_max_tokens: int = 0,
        pd_steps: str = "proxy",
        pd_prefill_timeout_s: float = 120.0,
    ) -> None:
        self.path = path
        self._hint_rules = HintRules(max_hint_bytes, test_hooks, session_header, slo_headers)
        self._test_hooks = test_hooks  # GIE conformance hooks (requests.enable_test_hooks)
        self._pool = pool
        self._upstream = upstream
        self._max_body_bytes = max_body_bytes
        self._max_model_bytes = max_model_bytes
        self._resume, self._resume_max, self._resume_max_tokens = resume, resume_max, resume_max_tokens
        # a pair's steps: sent here (proxy), or left to the decode replica's sidecar, told by header
        self._pd = PdSteps(upstream, path, pd_prefill_timeout_s) if pd_steps == "proxy" else None
        self._exchanges: set[Exchange] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open_exchanges(self) -> int:
        return len(self._exchanges)

    async def handle_http1(self, request: web.BaseRequest) -> web.StreamResponse:
        """aiohttp's handler: one HTTP/1.1 request."""
        down = Http1Downstream(request)
        await self.serve(down)
        if down.response is None:  # unreachable: every path answers; never a bare 500 from aiohttp
            return translate.reply_response(reply_for(Outcome.INTERNAL_ERROR))
        return down.response

    async def serve(self, down: Downstream) -> None:
        if down.method == "GET" and down.path == _MODELS:
            await self._models(down)
            return
        body = await self._read_body(down)
        if isinstance(body, Reply):
            await down.reply(self.path.reject(body))
            return
        asked = down.header(headers.RESUME)
        resuming = self._resume is not ResumeMode.OFF or asked is not None
        parsed = parse_request(
            down.method,
            down.path,
            down.header(headers.CONTENT_TYPE),
            body,
            self._max_body_bytes,
            self._max_model_bytes,
            keep_fields=resuming,  # the resume rewrites the body from the one parse
        )
        if isinstance(parsed, Reply):
            await down.reply(self.path.reject(parsed))
            return
        hints = read_hints(down.header, self._hint_rules, self.path.objectives, self.path.eligible)
        if isinstance(hints, Reply):
            await down.reply(self.path.reject(hints))
            return
        splice, refused = None, None
        if resuming:
            ask = read_ask(asked)
            if isinstance(ask, Reply):
                await down.reply(self.path.reject(ask))
                return
            body, splice, refused = prepared(
                self._resume, ask, parsed.path, body, parsed.fields, self._resume_max_tokens
            )
            if ask is not True:
                refused = None  # said only to a client that asked
        tokens = await self.path.tokens(parsed) if self.path.wants_tokens(parsed) else None
        ticket = self.path.admit(
            parsed,
            flow=hints.flow,
            priority=hints.priority,
            allowed=hints.allowed,
            trace_context=hints.trace_context,
            session=hints.session,
            tokens=tokens,
            slo=hints.slo,
        )
        if not ticket.done:
            try:
                await ticket.wait()
            except asyncio.CancelledError:
                self.path.cancel(ticket)  # the client left while queued
                raise
        decision = self.path.settle(ticket)
        if isinstance(decision, Reply):
            await down.reply(decision)
            return
        decision.record.resumable = splice is not None
        exchange = Exchange(decision, body, asyncio.current_task(), splice)
        exchange.resume_refused = refused
        del body
        self._exchanges.add(exchange)
        self._idle.clear()
        try:
            await self._relay(down, exchange)
        except Exception:  # a defect: still the contract's answer, and the slot comes back
            log.exception("proxying request_id=%s failed", decision.record.request_id)
            self.path.finish(decision.record, EndReason.UPSTREAM_ERROR_STATUS)
            if down.started:
                down.abort()
            else:
                await down.reply(reply_for(Outcome.INTERNAL_ERROR))
        finally:
            self._exchanges.discard(exchange)
            if not self._exchanges:
                self._idle.set()

    async def _read_body(self, down: Downstream) -> bytes | Reply:
        limit = self._max_body_bytes
        too_large = reply_for(Outcome.TOO_LARGE, f"request body is larger than the limit of {limit} bytes")
        declared = down.content_length
        if declared is not None and declared > limit:
            return too_large  # refused unread: the connection closes after the reply
        body = bytearray()
        while chunk := await down.read(_READ_SIZE):
            body += chunk
            if len(body) > limit:
                return too_large
        return bytes(body)

    async def _relay(self, down: Downstream, exchange: Exchange) -> None:
        record = exchange.routed.record
        path = self.path
        routing = exchange.routed.headers
        if record.prefill_on is not None:  # a continuation (resume) never names the prefill replica
            routing = tuple(h for h in routing if h[0] != headers.PREFILLER)
        outgoing = translate.upstream_headers(down.header_items(), record.request_id, routing)
        exchange.outgoing = outgoing
        sent = outgoing
        if record.prefill_on is not None and self._pd is None:  # the decode replica's sidecar does the steps
            sent = [*outgoing, (headers.PREFILLER, record.prefill_on)]
        try:
            opened = None
            if record.prefill_on is not None and self._pd is not None:
                destination = exchange.routed.destinations[0]
                opened = await self._pd.open(record, destination, down.target, outgoing, exchange.body)
            if opened is None:
                opened = await self._upstream.open(
                    exchange.routed.destinations, down.method, down.target, sent, exchange.body
                )
        except UpstreamUnavailable as exc:
            log.warning("no upstream took request_id=%s: %s", record.request_id, exc)
            path.upstream_retried(record, exc.attempts - 1)
            path.finish(record, EndReason.UPSTREAM_ERROR_STATUS)
            message = "no model server answered: refused, reset or timed out"
            await down.reply(reply_for(Outcome.REJECTED_NO_ENDPOINTS, message))
            return
        except asyncio.CancelledError:
            cut = exchange.take_cut()
            if cut is None:
                path.finish(record, EndReason.CLIENT_DISCONNECT)
                raise
            path.finish(record, EndReason.REJECTED)
            await down.reply(cut)
            return
        exchange.body = b""  # the commit point: nothing is replayed from here on
        try:
            await self._stream(down, exchange, opened)
        finally:
            opened.response.close()  # unfinished: its connection closes, so vLLM aborts (else: pooled)

    async def _stream(self, down: Downstream, exchange: Exchange, opened: Opened) -> None:
        record = exchange.routed.record
        path = self.path
        upstream = opened.response
        streaming = translate.is_event_stream(upstream.headers)
        path.response_started(record, upstream.status, opened.served, streaming)
        path.upstream_retried(record, opened.attempts - 1)  # counted against who served, as Envoy's log
        splice = exchange.splice if streaming and upstream.status == 200 else None
        tail = b""
        try:
            response_headers = translate.downstream_headers(
                upstream.headers.items(), opened.served, record.request_id
            )
            if self._test_hooks:
                response_headers.append((headers.TEST_SERVED_ENDPOINT, opened.served))
            if exchange.resume_refused is not None:  # the client asked for resume: why not
                response_headers.append((headers.RESUME_REFUSED, exchange.resume_refused))
                path.resume_refused("not-resumable")
            await down.start(upstream.status, response_headers)
            if splice is None:
                tail = await self._pass_through(down, record, opened)
            else:  # whole events only: `tail` stays b"", at an event boundary
                await relay_resumable(self.path, self._upstream, self._resume_max, down, exchange, opened)
            await down.finish()
        except asyncio.CancelledError:
            cut = exchange.take_cut()
            if cut is None:
                path.response_ended(record, False, EndReason.CLIENT_DISCONNECT)
                raise
            path.response_ended(record, False, EndReason.SHUTDOWN_CUT)  # the picker's cut, not the replica's
            await self._write_cut(down, cut, streaming, tail)
            return
        except UpstreamCut as exc:
            log.info("upstream cut request_id=%s: %s", record.request_id, exc)
            path.response_ended(record, False, EndReason.UPSTREAM_TRUNCATED)
            down.abort()  # the client must see a cut, not a clean end
            return
        except _CLIENT_GONE:
            path.response_ended(record, False, EndReason.CLIENT_DISCONNECT)
            return
        path.response_ended(record, True, EndReason.COMPLETED)

    async def _pass_through(self, down: Downstream, record: RequestRecord, opened: Opened) -> bytes:
        """The response's bytes as they come (the common case); returns the last chunk written."""
        tail = b""
        if opened.head is not None:  # read while deciding whether to try the next endpoint
            self.path.body_chunk(record, opened.head)
            tail = opened.head
            await down.write(opened.head)
        if not opened.complete:
            reader = opened.response.content
            while True:
                try:
                    chunk = await reader.readany()
                except UPSTREAM_READ_ERRORS as exc:
                    raise UpstreamCut(type(exc).__name__) from exc
                if not chunk:
                    break
                self.path.body_chunk(record, chunk)
                tail = chunk
                await down.write(chunk)  # back-pressure: waits while the client's buffer is full
        return tail

    async def _write_cut(self, down: Downstream, cut: Reply, streaming: bool, tail: bytes) -> None:
        """The drain deadline reached a started exchange: close it as the protocol allows."""
        if not down.started:
            await down.reply(cut)
        elif not streaming:
            down.abort()  # half a JSON body must not look complete
        else:
            try:
                await down.write(translate.stream_cut_tail(cut, translate.at_event_boundary(tail)))
                await down.finish()
            except _CLIENT_GONE:
                pass

    async def _models(self, down: Downstream) -> None:
        """GET /v1/models from one ready endpoint: no admission, nothing to track."""
        ready = self._pool.ready()
        if not ready:
            await down.reply(self.path.reject(reply_for(Outcome.REJECTED_NO_ENDPOINTS)))
            return
        served = random.choice(ready).address
        outgoing = translate.upstream_headers(down.header_items(), "")
        try:
            opened = await self._upstream.open([served], "GET", down.target, outgoing, b"")
            try:
                content = (opened.head or b"") + (b"" if opened.complete else await opened.response.read())
            finally:
                opened.response.close()
        except (UpstreamUnavailable, *UPSTREAM_READ_ERRORS):
            await down.reply(reply_for(Outcome.REJECTED_NO_ENDPOINTS))
            return
        response_headers = translate.downstream_headers(opened.response.headers.items(), opened.served, "")
        try:
            await down.start(opened.response.status, response_headers)
            await down.write(content)
            await down.finish()
        except _CLIENT_GONE:
            pass

    def stalled(self, record: RequestRecord) -> bool:
        """The core saw this stream stall: continue it elsewhere if it is resumable (a stream whose
        replica is gone is woken even with no tries left: the relay ends its part and cuts it)."""
        for exchange in self._exchanges:
            if exchange.routed.record is record:
                return exchange.move(Why.STALLED, gone=not self.path.may_stay(record))
        return False

    def move_streams(self, address: str) -> int:
        """Continue every resumable stream running on `address` on other replicas (a drain that
        does not wait for its longest answer). Returns how many began to move."""
        return sum(
            1
            for exchange in list(self._exchanges)
            if exchange.current is not None and exchange.current.served == address and exchange.move()
        )

    def cut_all(self, reply: Reply) -> int:
        """The drain deadline: end every open exchange with `reply`. Returns how many were cut."""
        exchanges = list(self._exchanges)
        for exchange in exchanges:
            exchange.cut(reply)
        return len(exchanges)

    async def wait_idle(self, timeout: float) -> bool:  # noqa: ASYNC109 (a bound on the wait)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
