"""POST /v1/completions and /v1/chat/completions: one request's life inside a replica.

Order of checks, as vLLM: body (400) -> model (404) -> drain (500) -> length (400) -> injected status ->
slow headers -> admission (503 when the waiting queue is full). A streaming request gets its 200 headers
as soon as it is admitted (running or queued); tokens follow absolute deadlines (see timing.py).

A client disconnect cancels the handler task (aiohttp handler_cancellation) or fails a write; either way
the `finally` frees the slot at once and the request counts as aborted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from http import HTTPStatus

from aiohttp import web

from loadtest.sim.config import AbortStyle
from loadtest.sim.engine import Admission, InFlight, Interrupt
from loadtest.sim.faults import FaultSpec, MidStreamFault, parse_fault_header
from loadtest.sim.openai_format import (
    BUSY_MESSAGE,
    DONE_FRAME,
    DRAIN_MESSAGE,
    ENGINE_ERROR_MESSAGE,
    ApiError,
    Endpoint,
    ParsedRequest,
    StreamEncoder,
    bad_request,
    check_length,
    completion_body,
    parse_request,
    stream_error_frame,
)
from loadtest.sim.requestlog import Outcome, RequestRecord
from loadtest.sim.state import ReplicaState
from loadtest.sim.timing import TokenPlan, parse_overrides, plan_tokens

STATE_KEY = web.AppKey("sim_state", ReplicaState)
REQUEST_ID_HEADER = "x-request-id"
FAULT_HEADER = "x-sim-fault"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8"}


class _Refused(Exception):
    """A request answered with an error before any token."""

    def __init__(self, error: ApiError, outcome: Outcome, reason: str) -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome
        self.reason = reason


class Stop(enum.Enum):
    COMPLETED = "completed"
    FAULT = "fault"
    INTERRUPTED = "interrupted"


@dataclass(slots=True)
class Call:
    """A validated request and what the simulator will do with it."""

    parsed: ParsedRequest
    plan: TokenPlan
    fault: FaultSpec | None
    arrival: float  # loop time
    response_id: str
    created: int


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.CHAT)


def _json(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    loop = asyncio.get_running_loop()
    arrival = loop.time()
    record = state.log.open(request.headers.get(REQUEST_ID_HEADER), endpoint.value)
    state.stats.received += 1
    try:
        call = await _validate(request, state, endpoint, record, arrival)
    except _Refused as refusal:
        return _refuse(state, record, refusal)
    except asyncio.CancelledError:
        _client_gone(state, record)
        raise
    flight = InFlight(loop, record, call.parsed.prompt_tokens)
    state.enter(flight)
    try:
        return await _run(request, state, call, flight)
    except _Refused as refusal:
        return _refuse(state, record, refusal)
    except asyncio.CancelledError:
        _client_gone(state, record)
        raise
    except ConnectionError:  # a write found the client gone before the cancellation arrived
        _client_gone(state, record)
        return _unsent()
    finally:
        state.engine.release(flight)
        state.leave(flight)


def _client_gone(state: ReplicaState, record: RequestRecord) -> None:
    if state.end(record, Outcome.ABORTED):
        state.stats.aborted += 1


def _refuse(state: ReplicaState, record: RequestRecord, refusal: _Refused) -> web.Response:
    record.status = refusal.error.status
    state.stats.rejected[refusal.reason] += 1
    state.end(record, refusal.outcome)
    return _json(refusal.error.status, refusal.error.body())


async def _validate(
    request: web.Request, state: ReplicaState, endpoint: Endpoint, record: RequestRecord, arrival: float
) -> Call:
    config = state.config
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _Refused(
            ApiError(413, "Request body too large", "RequestEntityTooLarge"), Outcome.BAD_REQUEST, "too-large"
        ) from None
    try:
        parsed = parse_request(endpoint, body, config.model, config.capacity.default_max_tokens)
        record.model, record.stream, record.prompt_tokens = parsed.model, parsed.stream, parsed.prompt_tokens
        try:
            overrides = parse_overrides(request.headers)
            header_fault = request.headers.get(FAULT_HEADER)
            fault = parse_fault_header(header_fault) if header_fault is not None else None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    except ApiError as err:
        outcome = Outcome.NOT_FOUND if err.status == 404 else Outcome.BAD_REQUEST
        raise _Refused(err, outcome, "unknown-model" if err.status == 404 else "bad-request") from None
    if state.draining:
        raise _Refused(
            ApiError(500, DRAIN_MESSAGE, "InternalServerError"), Outcome.SHUTDOWN_500, "shutting-down"
        )
    effective = parsed.max_tokens if overrides.max_tokens is None else overrides.max_tokens
    try:
        check_length(dataclasses.replace(parsed, max_tokens=effective), config.capacity)
    except ApiError as err:
        raise _Refused(err, Outcome.BAD_REQUEST, "bad-request") from None
    if fault is None:
        fault = state.faults.take()
    if fault is not None and fault.status is not None:
        raise _Refused(_status_error(fault.status), Outcome.FAULT_STATUS, "fault")
    key = record.request_id if REQUEST_ID_HEADER in request.headers else state.next_key()
    plan = plan_tokens(
        config.latency, key, parsed.prompt_tokens, parsed.max_tokens, parsed.ignore_eos, overrides
    )
    prefix = "cmpl-" if endpoint is Endpoint.COMPLETIONS else "chatcmpl-"
    return Call(parsed, plan, fault, arrival, prefix + secrets.token_hex(16), int(time.time()))


def _unsent() -> web.Response:
    """The return value of a handler whose connection is already closed: it never reaches the client."""
    return web.Response(status=500)


def _status_error(status: int) -> ApiError:
    """vLLM-style bodies for an injected status."""
    if status == 503:
        return ApiError(503, BUSY_MESSAGE, "Service Unavailable")
    if status == 500:
        return ApiError(500, ENGINE_ERROR_MESSAGE, "InternalServerError")
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    return ApiError(status, f"{phrase} (injected by the simulator)", phrase)


async def _run(request: web.Request, state: ReplicaState, call: Call, flight: InFlight) -> web.StreamResponse:
    loop = asyncio.get_running_loop()
    if call.fault is not None and call.fault.slow_headers_ms:
        await flight.wait(loop.time() + call.fault.slow_headers_ms / 1000)
    if state.engine.admit(flight) is Admission.REJECTED:
        state.stats.admission_rejections += 1
        raise _Refused(ApiError(503, BUSY_MESSAGE, "Service Unavailable"), Outcome.REJECTED, "queue-full")
    response: web.StreamResponse | None = None
    encoder: StreamEncoder | None = None
    if call.parsed.stream:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        encoder = StreamEncoder(call.parsed.endpoint, call.response_id, call.created, call.parsed.model)
        flight.record.status = 200
    stop = await _generate(state, flight, call, response, encoder)
    if stop is Stop.COMPLETED:
        return await _complete(state, flight, call, response, encoder)
    if stop is Stop.FAULT:
        return await _strike(request, state, flight, call, response)
    return await _interrupted(request, state, flight, call, response, encoder)


async def _generate(
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
) -> Stop:
    """Wait for a slot, then emit tokens on their deadlines. The hot loop of the simulator."""
    loop = asyncio.get_running_loop()
    engine, stats, record, plan = state.engine, state.stats, flight.record, call.plan
    while not flight.running:
        if flight.interrupt is not None:
            return Stop.INTERRUPTED
        await flight.wait(None)
    t_slot = loop.time()
    stats.queue_time.observe(t_slot - call.arrival)
    t_first = t_slot + plan.ttft_s
    await flight.wait(t_first)
    if flight.interrupt is not None:
        return Stop.INTERRUPTED
    fault = call.fault
    fault_at = fault.after_tokens if fault is not None and fault.mid_stream is not None else None
    total, per_chunk = plan.output_tokens, state.config.latency.tokens_per_chunk
    write = response.write if response is not None else None
    sent, previous = 0, t_first
    while sent < total:
        if fault_at is not None and sent >= fault_at:
            return Stop.FAULT
        count = 1 if sent == 0 else min(per_chunk, total - sent)
        if fault_at is not None:
            count = min(count, fault_at - sent)
        if sent:
            due = plan.deadline(t_first, sent + count - 1)
            if due > loop.time():
                await flight.wait(due)
                if flight.interrupt is not None:
                    return Stop.INTERRUPTED
        now = loop.time()
        if sent == 0:
            record.first_token_at = time.time()
            stats.ttft.observe(now - call.arrival)
            stats.prompt_tokens += flight.prompt_tokens
        else:
            stats.itl.observe((now - previous) / count, count)
        previous = now
        if write is not None and encoder is not None:
            frame = (
                encoder.last(count, plan.finish_reason) if sent + count == total else encoder.tokens(count)
            )
            if sent == 0 and call.parsed.endpoint is Endpoint.CHAT:
                frame = encoder.role() + frame
            await write(frame)
        sent += count
        engine.add_tokens(flight, count)
        stats.generation_tokens += count
        record.tokens_sent = sent
    if fault_at is not None:  # a fault at or beyond the last token strikes before usage and [DONE]
        return Stop.FAULT
    return Stop.COMPLETED


def _tail(call: Call, encoder: StreamEncoder, completion_tokens: int) -> bytes:
    usage = encoder.usage(call.parsed.prompt_tokens, completion_tokens) if call.parsed.include_usage else b""
    return usage + DONE_FRAME


async def _complete(
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
) -> web.StreamResponse:
    finish_reason = call.plan.finish_reason
    if response is not None and encoder is not None:
        await response.write(_tail(call, encoder, flight.generated))
        await response.write_eof()
    else:
        flight.record.status = 200
        response = _json(200, _body(call, flight.generated, finish_reason))
    stats = state.stats
    stats.served += 1
    stats.success[finish_reason] += 1
    stats.e2e.observe(asyncio.get_running_loop().time() - call.arrival)
    state.end(flight.record, Outcome.COMPLETED, finish_reason)
    return response


def _body(call: Call, tokens: int, finish_reason: str) -> bytes:
    parsed = call.parsed
    return completion_body(
        parsed.endpoint,
        call.response_id,
        call.created,
        parsed.model,
        parsed.prompt_tokens,
        tokens,
        finish_reason,
    )


async def _strike(
    request: web.Request,
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
) -> web.StreamResponse:
    fault = call.fault
    assert fault is not None and fault.mid_stream is not None
    record = flight.record
    if fault.mid_stream is MidStreamFault.RESET:
        state.end(record, Outcome.RESET)
        _reset(request)
        return response or _unsent()
    if fault.mid_stream is MidStreamFault.ERROR:
        state.stats.success["error"] += 1
        state.end(record, Outcome.ERROR, "error")
        return await _error_ending(record, response)
    state.end(record, Outcome.STALLED)  # the slot stays taken: the engine request is stuck
    await _hang(request, state, flight)
    return response or _unsent()


async def _error_ending(record: RequestRecord, response: web.StreamResponse | None) -> web.StreamResponse:
    if response is None:
        record.status = 500
        return _json(500, ApiError(500, ENGINE_ERROR_MESSAGE, "InternalServerError").body())
    await response.write(stream_error_frame() + DONE_FRAME)
    await response.write_eof()
    return response


async def _interrupted(
    request: web.Request,
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
) -> web.StreamResponse:
    record = flight.record
    interrupt = flight.interrupt
    if interrupt is Interrupt.FORCE_STOP:
        state.end(record, Outcome.KILLED)
        _close(request)
        return response or _unsent()
    style = state.abort_style if interrupt is Interrupt.SHUTDOWN_ABORT else AbortStyle.HANG
    if style is AbortStyle.ABORT:
        state.stats.success["abort"] += 1
        state.stats.e2e.observe(asyncio.get_running_loop().time() - call.arrival)
        state.end(record, Outcome.SHUTDOWN_ABORT, "abort")
        if response is None or encoder is None:
            record.status = 200
            return _json(200, _body(call, flight.generated, "abort"))
        frame = encoder.last(0, "abort")
        if record.tokens_sent == 0 and call.parsed.endpoint is Endpoint.CHAT:
            frame = encoder.role() + frame
        await response.write(frame + _tail(call, encoder, flight.generated))
        await response.write_eof()
        return response
    if style is AbortStyle.ERROR:
        state.stats.success["error"] += 1
        state.end(record, Outcome.SHUTDOWN_ERROR, "error")
        return await _error_ending(record, response)
    state.end(record, Outcome.HUNG)
    state.engine.release(flight)  # the engine is gone; only the connection remains
    await _hang(request, state, flight)
    return response or _unsent()


async def _hang(request: web.Request, state: ReplicaState, flight: InFlight) -> None:
    """Send nothing and keep the connection until the client leaves (cancellation), a forced stop or the
    hang limit; then close the connection without ending the HTTP response."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + state.config.shutdown.hang_limit_s
    while flight.interrupt is not Interrupt.FORCE_STOP and loop.time() < deadline:
        await flight.wait(deadline, wake_on=Interrupt.FORCE_STOP)
    _close(request)


def _close(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        transport.close()


def _reset(request: web.Request) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashing server or a middlebox would."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()
