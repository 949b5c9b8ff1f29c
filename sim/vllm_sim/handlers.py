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
import time
from collections import Counter
from http import HTTPStatus

from aiohttp import web

from vllm_sim.config import KvLoadFailurePolicy
from vllm_sim.disagg import KvIntent, RemotePrefill, parse_kv_params, pull, transfer_s
from vllm_sim.endings import Call, complete, interrupted, json_response, kv_load_failed, strike, unsent
from vllm_sim.engine import Admission, InFlight
from vllm_sim.faults import parse_fault_header
from vllm_sim.openai_format import (
    BUSY_MESSAGE,
    DRAIN_MESSAGE,
    ENGINE_ERROR_MESSAGE,
    ApiError,
    Endpoint,
    StreamEncoder,
    bad_request,
    check_length,
    parse_request,
)
from vllm_sim.requestlog import Outcome, RequestRecord
from vllm_sim.sampled_stream import SampledEncoder
from vllm_sim.sidecar import sidecar_step
from vllm_sim.state import ReplicaState, log
from vllm_sim.timing import TokenPlan, parse_overrides, plan_tokens

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
    KV_LOAD_FAILED = "kv-load-failed"


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.COMPLETIONS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.CHAT)


async def _serve(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    state = request.app[STATE_KEY]
    loop = asyncio.get_running_loop()
    arrival = loop.time()
    record = state.log.open(request.headers.get(REQUEST_ID_HEADER), endpoint.value)
    record.traceparent = request.headers.get("traceparent")
    record.prefiller = request.headers.get("x-prefiller-host-port")
    state.stats.received += 1
    try:
        # the routing sidecar's prefill step comes first (sidecar.py)
        body = await sidecar_step(request) if state.config.disagg.sidecar else None
        if isinstance(body, int):
            record.status = body
            state.end(record, Outcome.PREFILL_FAILED)
            return web.Response(status=body)
        call = await _validate(request, state, endpoint, record, arrival, body)
    except _Refused as refusal:
        return _refuse(state, record, refusal)
    except asyncio.CancelledError:
        _client_gone(state, record)
        raise
    parsed = call.parsed
    flight = InFlight(loop, record, parsed.prompt_tokens, parsed.token_ids, parsed.cache_salt, parsed.lora)
    # vLLM skips reading the prefix cache for a request that asks prompt_logprobs
    flight.skip_cache_read = parsed.sampling is not None and parsed.sampling.prompt_logprobs is not None
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
        return unsent()
    except Exception:
        log.exception("request %s: simulator bug", record.request_id)
        state.end(record, Outcome.INTERNAL_ERROR)
        raise
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
    response = json_response(refusal.error.status, refusal.error.body())
    if refusal.outcome is Outcome.SHUTDOWN_500:
        response.force_close()  # real vLLM closes the connection after this 500 (measured)
    return response


async def _validate(
    request: web.Request,
    state: ReplicaState,
    endpoint: Endpoint,
    record: RequestRecord,
    arrival: float,
    body: bytes | None = None,
) -> Call:
    """`body`: the request as the sidecar's prefill step rewrote it (None: as it came)."""
    config = state.config
    try:
        if body is None:
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _Refused(
            ApiError(413, "Request body too large", "RequestEntityTooLarge"), Outcome.BAD_REQUEST, "too-large"
        ) from None
    try:
        parsed = parse_request(
            endpoint,
            body,
            config.model,
            config.capacity.default_max_tokens,
            config.cache.lora_modules,
            config.cache.force_include_usage,
        )
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
    min_tokens = parsed.sampling.min_tokens if parsed.sampling is not None else 0
    plan = plan_tokens(
        config.latency, key, parsed.prompt_tokens, parsed.max_tokens, parsed.ignore_eos, overrides, min_tokens
    )
    slowdown = state.engine.slowdown
    if slowdown != 1.0:  # a slower replica: every duration of the plan, stretched
        plan.ttft_s, plan.itl_s = plan.ttft_s * slowdown, plan.itl_s * slowdown
        plan.per_prompt_token_s *= slowdown
        plan.itl_per_running_s *= slowdown
    prefix = "cmpl-" if endpoint is Endpoint.COMPLETIONS else "chatcmpl-"
    kv = parse_kv_params(parsed.kv_transfer_params)
    record.remote_decode = kv is KvIntent.REMOTE_DECODE
    return Call(parsed, plan, fault, arrival, prefix + secrets.token_hex(16), int(time.time()), kv)


async def _prefill(state: ReplicaState, flight: InFlight, call: Call, t_slot: float) -> float | Stop:
    """When the first token is due (loop time), or how the request ends before it.

    Local prefill: cached blocks found (and this prompt's stored); with a prefill rate, its uncached
    tokens wait for the shared prefill compute. Cached tokens save their per-token TTFT too. A decode
    given a remote prefill pulls the blocks it lacks instead and computes none of the prompt; a failed
    pull ends it ("fail", vLLM's default) or falls back to the local prefill ("recompute")."""
    engine, plan = state.engine, call.plan
    ttft_s = state.config.cache.lora_load_ms / 1000 if flight.lora_loaded else 0.0
    if isinstance(call.kv, RemotePrefill):
        engine.lookup(flight)
        pulled = await _pull(state, flight, call.kv)
        if flight.interrupt is not None:
            return Stop.INTERRUPTED
        if pulled:
            flight.external_tokens = max(0, flight.prompt_tokens - flight.cached_tokens)
            return (
                asyncio.get_running_loop().time()
                + ttft_s
                + max(0.0, plan.ttft_s - plan.per_prompt_token_s * flight.prompt_tokens)
            )
        state.kv.pulls_failed += 1
        if state.config.disagg.load_failure_policy is KvLoadFailurePolicy.FAIL:
            return Stop.KV_LOAD_FAILED
        t_prefilled = engine.compute(flight, asyncio.get_running_loop().time())
    else:
        t_prefilled = engine.prefill(flight, t_slot)
    return t_prefilled + ttft_s + max(0.0, plan.ttft_s - plan.per_prompt_token_s * flight.cached_tokens)


async def _pull(state: ReplicaState, flight: InFlight, remote: RemotePrefill) -> bool:
    """Pull the prompt's blocks this replica's cache lacks; a shutdown's cut ends the wait at once.

    With nothing to pull the prefill is still told, so it frees its blocks (vLLM sends the same
    notification), and that call's failure fails nothing."""
    block_size = state.config.cache.block_size
    blocks = max(0, -(-flight.prompt_tokens // block_size) - flight.cached_tokens // block_size)
    task = asyncio.get_running_loop().create_task(
        pull(remote, blocks, transfer_s(state.config.disagg, blocks))
    )
    task.add_done_callback(lambda _done: flight.wake())
    try:
        while not task.done():
            await flight.wait(None)
            if flight.interrupt is not None:
                return False
        return task.result() or blocks == 0
    finally:
        task.cancel()  # ours; a no-op once done


def _count_sources(by_source: Counter[str], flight: InFlight) -> None:
    cached, external = flight.cached_tokens, flight.external_tokens
    by_source["local_cache_hit"] += cached
    by_source["external_kv_transfer"] += external
    by_source["local_compute"] += max(0, flight.prompt_tokens - cached - external)


def _sampled_frame(encoder: SampledEncoder, plan: TokenPlan, count: int, last: bool) -> tuple[bytes, int]:
    """The chunk of the next `count` tokens and how many it carries: fewer when a stop ends the
    output sooner. A stop string or stop token makes the output's finish_reason "stop"."""
    frame, step = encoder.next(count, plan.finish_reason if last else None)
    if step.finish_reason is not None:
        plan.finish_reason = step.finish_reason
    return frame, len(step.ids)


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
        if call.parsed.sampled_stream:
            encoder = SampledEncoder(call.parsed, call.response_id, call.created)
        else:
            encoder = StreamEncoder(call.parsed.endpoint, call.response_id, call.created, call.parsed.model)
        flight.record.status = 200
    stop = await _generate(state, flight, call, response, encoder)
    if stop is Stop.COMPLETED:
        # Like vLLM, the engine lets go of a finished request before its last chunks reach the
        # client: the slot is free (and the metrics say so) while [DONE] is still on its way.
        state.engine.release(flight)
        params = None
        if call.kv is KvIntent.REMOTE_DECODE:  # a prefill: its blocks wait for the decode's pull
            # the engine request's id, as vLLM names it; the tokens computed (the last one never is)
            computed = flight.prompt_tokens + flight.generated - 1
            engine_request_id = f"{call.response_id}-0-{secrets.token_hex(4)}"
            params = state.kv.hold(engine_request_id, computed, flight.cached_tokens)
        return await complete(state, flight, call, response, encoder, params)
    if stop is Stop.KV_LOAD_FAILED:
        return await kv_load_failed(state, flight, response)
    if stop is Stop.FAULT:
        return await strike(request, state, flight, call, response)
    return await interrupted(request, state, flight, call, response, encoder)


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
    t_first = await _prefill(state, flight, call, t_slot)
    if isinstance(t_first, Stop):
        return t_first
    await flight.wait(t_first)
    if flight.interrupt is not None:
        return Stop.INTERRUPTED
    fault = call.fault
    fault_at = fault.after_tokens if fault is not None and fault.mid_stream is not None else None
    total, per_chunk = plan.output_tokens, state.config.latency.tokens_per_chunk
    write = response.write if response is not None else None
    sent, previous, previous_due = 0, t_first, t_first
    sampled = encoder if isinstance(encoder, SampledEncoder) else None
    chat = call.parsed.endpoint is Endpoint.CHAT
    while sent < total:
        if fault_at is not None and sent >= fault_at:
            return Stop.FAULT
        count = 1 if sent == 0 else min(per_chunk, total - sent)
        if fault_at is not None:
            count = min(count, fault_at - sent)
        if not sent:
            due = t_first
        elif plan.itl_per_running_s:  # each step as long as the batch it runs in makes it
            due = previous_due + count * plan.step_s(len(engine.running))
        else:
            due = plan.deadline(t_first, sent + count - 1)
        previous_due = due
        if due > loop.time():
            await flight.wait(due)
            if flight.interrupt is not None:
                return Stop.INTERRUPTED
        frame = None
        if write is not None and encoder is not None:
            if sampled is not None:  # tokens and text of its own, stops, logprobs...
                frame, count = _sampled_frame(sampled, plan, count, sent + count == total)
                if sampled.sampler.finished:
                    total = sent + count
            elif sent + count == total:
                frame = encoder.last(count, plan.finish_reason)
            else:
                frame = encoder.tokens(count)
            if sent == 0 and chat:
                frame = encoder.role() + frame
        now = loop.time()
        stats.lateness.observe(now - due)
        if sent == 0:
            record.first_token_at = time.time()
            stats.ttft.observe(now - call.arrival)
            stats.prompt_tokens += flight.prompt_tokens
            _count_sources(stats.prompt_by_source, flight)
        else:
            stats.itl.observe((now - previous) / count, count)
        previous = now
        if frame is not None and write is not None:
            await write(frame)
        sent += count
        engine.add_tokens(flight, count)
        stats.generation_tokens += count
        record.tokens_sent = sent
    if fault_at is not None:  # a fault at or beyond the last token strikes before usage and [DONE]
        return Stop.FAULT
    return Stop.COMPLETED
