"""How a completion's response ends: completed, struck by an injected fault, or cut by a shutdown.

Each ending writes vLLM's bytes for that case (final frames, the in-stream error event, nothing at all for
a hang, a TCP RST for a reset), closes the request's record and bumps the counters vLLM would.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass
from typing import Any, assert_never

from aiohttp import web

from vllm_sim.config import AbortStyle
from vllm_sim.disagg import KvIntent, RemotePrefill
from vllm_sim.engine import InFlight, Interrupt
from vllm_sim.faults import FaultSpec, MidStreamFault
from vllm_sim.openai_format import (
    DONE_FRAME,
    ENGINE_ERROR_MESSAGE,
    KV_LOAD_FAILED_MESSAGE,
    ApiError,
    Endpoint,
    ParsedRequest,
    StreamEncoder,
    completion_body,
    stream_error_frame,
)
from vllm_sim.requestlog import Outcome, RequestRecord
from vllm_sim.state import ReplicaState
from vllm_sim.timing import TokenPlan


@dataclass(slots=True)
class Call:
    """A validated request and what the simulator will do with it."""

    parsed: ParsedRequest
    plan: TokenPlan
    fault: FaultSpec | None
    arrival: float  # loop time
    response_id: str
    created: int
    kv: KvIntent | RemotePrefill | None = None  # what its kv_transfer_params ask (disagg.py)


def json_response(status: int, body: bytes) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json")


def unsent() -> web.Response:
    """The return value of a handler whose connection is already closed: it never reaches the client."""
    return web.Response(status=500)


def _tail(call: Call, encoder: StreamEncoder, completion_tokens: int, cached: int | None = None) -> bytes:
    if not call.parsed.include_usage:
        return DONE_FRAME
    return encoder.usage(call.parsed.prompt_tokens, completion_tokens, cached) + DONE_FRAME


def _cached(state: ReplicaState, flight: InFlight, call: Call | None = None) -> int | None:
    """usage.prompt_tokens_details.cached_tokens, when the replica reports it (vLLM's flag). A decode
    reports its prefill's cache hits, not the pulled tokens (vLLM: remote_prefill_cached_tokens)."""
    if not state.config.cache.prompt_tokens_details:
        return None
    kv = call.kv if call is not None else None
    if isinstance(kv, RemotePrefill) and kv.prefill_cached_tokens is not None and flight.external_tokens:
        return kv.prefill_cached_tokens
    return flight.cached_tokens


async def complete(
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> web.StreamResponse:
    """`kv_transfer_params`: a prefill's hand-off; vLLM returns it in JSON bodies only, never in a stream."""
    finish_reason = call.plan.finish_reason
    if response is not None and encoder is not None:
        await response.write(_tail(call, encoder, flight.generated, _cached(state, flight, call)))
        await response.write_eof()
    else:
        flight.record.status = 200
        body = _body(call, flight.generated, finish_reason, _cached(state, flight, call), kv_transfer_params)
        response = json_response(200, body)
    stats = state.stats
    stats.served += 1
    stats.success[finish_reason] += 1
    stats.e2e.observe(asyncio.get_running_loop().time() - call.arrival)
    state.end(flight.record, Outcome.COMPLETED, finish_reason)
    return response


def _body(
    call: Call,
    tokens: int,
    finish_reason: str,
    cached: int | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
) -> bytes:
    parsed = call.parsed
    return completion_body(
        parsed.endpoint,
        call.response_id,
        call.created,
        parsed.model,
        parsed.prompt_tokens,
        tokens,
        finish_reason,
        cached,
        kv_transfer_params,
    )


async def strike(
    request: web.Request,
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
) -> web.StreamResponse:
    fault = call.fault
    assert fault is not None and fault.mid_stream is not None
    record = flight.record
    match fault.mid_stream:
        case MidStreamFault.RESET:
            state.end(record, Outcome.RESET)
            _reset(request)
            return response or unsent()
        case MidStreamFault.ERROR:
            state.stats.success["error"] += 1
            state.end(record, Outcome.ERROR, "error")
            return await _error_ending(record, response)
        case MidStreamFault.STALL:
            state.end(record, Outcome.STALLED)  # the slot stays taken: the engine request is stuck
            await _hang(request, state, flight)
            return response or unsent()
        case unreachable:
            assert_never(unreachable)


async def kv_load_failed(
    state: ReplicaState, flight: InFlight, response: web.StreamResponse | None
) -> web.StreamResponse:
    """vLLM's default kv_load_failure_policy "fail": the request finishes with reason "error", which its
    server raises as GenerationError: a 500 for a JSON response, the error event + [DONE] in a stream."""
    record = flight.record
    state.stats.success["error"] += 1
    state.end(record, Outcome.KV_LOAD_FAILED, "error")
    if response is None:
        record.status = 500
        return json_response(500, ApiError(500, KV_LOAD_FAILED_MESSAGE, "InternalServerError").body())
    await response.write(stream_error_frame(KV_LOAD_FAILED_MESSAGE) + DONE_FRAME)
    await response.write_eof()
    return response


async def _error_ending(record: RequestRecord, response: web.StreamResponse | None) -> web.StreamResponse:
    if response is None:
        record.status = 500
        return json_response(500, ApiError(500, ENGINE_ERROR_MESSAGE, "InternalServerError").body())
    await response.write(stream_error_frame() + DONE_FRAME)
    await response.write_eof()
    return response


async def interrupted(
    request: web.Request,
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
) -> web.StreamResponse:
    record = flight.record
    interrupt = flight.interrupt
    assert interrupt is not None
    match interrupt:
        case Interrupt.FORCE_STOP:
            state.end(record, Outcome.KILLED)
            _close(request)
            return response or unsent()
        case Interrupt.DRAIN_HANG:
            return await _hang_ending(request, state, flight, response)
        case Interrupt.SHUTDOWN_ABORT:
            pass
        case unreachable:
            assert_never(unreachable)
    match state.abort_style:
        case AbortStyle.ABORT:
            return await _abort_ending(state, flight, call, response, encoder)
        case AbortStyle.ERROR:
            state.stats.success["error"] += 1
            state.end(record, Outcome.SHUTDOWN_ERROR, "error")
            return await _error_ending(record, response)
        case AbortStyle.HANG:
            return await _hang_ending(request, state, flight, response)
        case unreachable_style:
            assert_never(unreachable_style)


async def _abort_ending(
    state: ReplicaState,
    flight: InFlight,
    call: Call,
    response: web.StreamResponse | None,
    encoder: StreamEncoder | None,
) -> web.StreamResponse:
    """vLLM's clean cut: a last chunk with finish_reason "abort" (+ usage when asked) + [DONE]."""
    record = flight.record
    state.stats.success["abort"] += 1
    state.stats.e2e.observe(asyncio.get_running_loop().time() - call.arrival)
    state.end(record, Outcome.SHUTDOWN_ABORT, "abort")
    if response is None or encoder is None:
        record.status = 200
        return json_response(200, _body(call, flight.generated, "abort"))
    frame = encoder.last(0, "abort")
    if record.tokens_sent == 0 and call.parsed.endpoint is Endpoint.CHAT:
        frame = encoder.role() + frame
    await response.write(frame + _tail(call, encoder, flight.generated))
    await response.write_eof()
    return response


async def _hang_ending(
    request: web.Request, state: ReplicaState, flight: InFlight, response: web.StreamResponse | None
) -> web.StreamResponse:
    state.end(flight.record, Outcome.HUNG)
    state.engine.release(flight)  # the engine is gone; only the connection remains
    await _hang(request, state, flight)
    return response or unsent()


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
