"""The routing session in every body mode and framing Envoy 1.40 uses, with fake ext_proc streams.

The message sequences are the ones measured on the real Envoy (see picker/extproc/routing.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from loadtest.procs import async_wait_until
from picker.contract import headers
from picker.extproc.service import ExtProcService, ResponseEnd
from picker.flow import FlowLimits
from picker.pool.scrapes import record_sample
from picker.scheduling import LoadPolicy
from picker.streams import EndReason
from tests.unit.extproc.test_extproc_service import BODY, body, make, request_headers, response_headers, run

MODE = processing_mode_pb2.ProcessingMode
A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


def first(
    request_mode: int = MODE.BUFFERED,
    response_mode: int = MODE.NONE,
    extra: dict[str, str] | None = None,
    subset: list[str] | None = None,
    eos: bool = False,
    method: str = "POST",
) -> ep.ProcessingRequest:
    """The first message of a routing stream, with the protocol_config Envoy 1.40 sends on it."""
    message = request_headers(extra, eos=eos, method=method)
    message.protocol_config.CopyFrom(
        ep.ProtocolConfiguration(request_body_mode=request_mode, response_body_mode=response_mode)
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({headers.DESTINATION_SUBSET: subset})
        message.metadata_context.filter_metadata[headers.SUBSET_HINT_NAMESPACE].CopyFrom(hint)
    return message


def trailers() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_trailers=ep.HttpTrailers())


def response_chunk(data: bytes, eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(response_body=ep.HttpBody(body=data, end_of_stream=eos))


def kinds(responses: list[ep.ProcessingResponse]) -> list[str]:
    return [r.WhichOneof("response") or "" for r in responses]


def destination(response: ep.ProcessingResponse) -> list[str]:
    lb = response.dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE].struct_value
    return lb.fields[headers.DESTINATION].string_value.split(",")


def mutation(response: ep.ProcessingResponse) -> ep.HeaderMutation:
    phase = response.WhichOneof("response")
    return getattr(response, phase).response.header_mutation  # type: ignore[no-any-return]


def reason(response: ep.ProcessingResponse) -> tuple[int, dict[str, str]]:
    immediate = response.immediate_response
    return immediate.status.code, {
        h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers
    }


# --- request body modes and framing ---------------------------------------------------------------


async def test_buffered_body_followed_by_trailers_is_decided_at_the_body() -> None:
    # h2 with trailers: Envoy sends the whole buffered body with end_of_stream=false
    h = make()
    responses = await run(h.service, [first(), body(BODY, eos=False), trailers(), response_headers(200)])
    assert kinds(responses) == ["request_headers", "request_body", "request_trailers", "response_headers"]
    assert len(destination(responses[1])) == 3
    assert h.path.arrivals == 1


async def test_empty_body_with_trailers_is_refused_at_the_trailers() -> None:
    # no body message at all: only the trailers say the request is complete
    h = make()
    responses = await run(h.service, [first(), trailers()])
    status, sent = reason(responses[-1])
    assert status == 400 and sent[headers.DROPPED_REASON] == "bad-request"


async def test_get_with_trailers_is_routed_by_metadata_at_the_trailers() -> None:
    h = make()
    responses = await run(h.service, [first(method="GET"), trailers()])
    assert kinds(responses) == ["request_headers", "request_trailers"]
    assert destination(responses[-1])


async def test_buffered_partial_cut_at_envoys_buffer_is_413() -> None:
    h = make()
    partial = body(BODY[:-5], eos=False)
    responses = await run(h.service, [first(MODE.BUFFERED_PARTIAL), partial])
    assert reason(responses[-1])[0] == 413


async def test_buffered_partial_whole_body_is_routed() -> None:
    h = make()
    responses = await run(h.service, [first(MODE.BUFFERED_PARTIAL), body(BODY, eos=False)])
    assert destination(responses[-1])


async def test_full_duplex_holds_the_headers_answer_then_echoes_the_body() -> None:
    h = make()
    chunks = [BODY[:7], BODY[7:]]
    messages = [first(MODE.FULL_DUPLEX_STREAMED), body(chunks[0], eos=False), body(chunks[1])]
    responses = await run(h.service, messages)
    assert kinds(responses) == ["request_headers", "request_body", "request_body"]
    assert len(destination(responses[0])) == 3
    echoed = [r.request_body.response.body_mutation.streamed_response for r in responses[1:]]
    assert [e.body for e in echoed] == chunks
    assert [e.end_of_stream for e in echoed] == [False, True]


async def test_full_duplex_never_echoes_a_redelivered_last_chunk() -> None:
    # envoyproxy/envoy#46237: the eos chunk may arrive twice; the model server must get it once
    h = make()
    messages = [first(MODE.FULL_DUPLEX_STREAMED), body(BODY), body(BODY)]
    responses = await run(h.service, messages)
    assert kinds(responses) == ["request_headers", "request_body"]


async def test_full_duplex_body_followed_by_trailers_is_refused() -> None:
    h = make()
    messages = [first(MODE.FULL_DUPLEX_STREAMED), body(BODY, eos=False), trailers()]
    responses = await run(h.service, messages)
    assert kinds(responses) == ["immediate_response"]
    assert reason(responses[0])[0] == 400
    assert h.path.live == 0


async def test_full_duplex_over_the_limit_is_413_before_the_end() -> None:
    h = make()
    messages = [first(MODE.FULL_DUPLEX_STREAMED), body(b"x" * 3000, eos=False), body(b"x" * 3000, eos=False)]
    responses = await run(h.service, messages)
    assert kinds(responses) == ["immediate_response"] and reason(responses[0])[0] == 413


async def test_full_duplex_queued_request_gets_no_timeout_override() -> None:
    # FULL_DUPLEX has no message timeout: an override would be a spurious message to Envoy
    h = make(endpoints=(A,))
    record_sample(h.pool.get(A), 10, 10, 0.99, time.monotonic())  # type: ignore[arg-type]
    h.path._policy = LoadPolicy(use_metrics=True)
    messages = [first(MODE.FULL_DUPLEX_STREAMED), body(BODY)]
    task = asyncio.ensure_future(run(h.service, messages))
    await async_wait_until(lambda: h.path.flow.queued == 1, 2, what="the request to queue")
    record_sample(h.pool.get(A), 0, 0, 0.0, time.monotonic())  # type: ignore[arg-type]
    h.path.capacity_changed()
    responses = await asyncio.wait_for(task, 2)
    assert "override_message_timeout" not in kinds(responses)
    assert kinds(responses) == ["request_headers", "request_body"]


async def test_streamed_is_decided_on_the_headers_and_the_body_goes_by() -> None:
    h = make()
    messages = [first(MODE.STREAMED), body(BODY[:5], eos=False), body(BODY[5:])]
    responses = await run(h.service, messages)
    assert kinds(responses) == ["request_headers", "request_body", "request_body"]
    assert destination(responses[0])
    assert not responses[1].request_body.response.HasField("body_mutation")


async def test_request_body_none_is_decided_on_the_headers() -> None:
    h = make()
    responses = await run(h.service, [first(MODE.NONE)])
    assert destination(responses[0])


async def test_immediate_reply_from_the_headers_phase_in_full_duplex() -> None:
    h = make()
    responses = await run(h.service, [first(MODE.FULL_DUPLEX_STREAMED, subset=["10.9.9.9:1"])])
    status, sent = reason(responses[0])
    assert status == 503 and sent[headers.DROPPED_REASON] == "rejected-no-endpoints"


# --- response body modes --------------------------------------------------------------------------


async def test_full_duplex_response_chunks_are_echoed_and_tracked() -> None:
    h = make()
    sse = [b'data: {"choices":[{"text":"a"}]}\n\n', b"data: [DONE]\n\n"]
    messages = [
        first(MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED),
        body(BODY),
        response_headers(200, A),
        response_chunk(sse[0], False),
        response_chunk(sse[1], False),
        ep.ProcessingRequest(response_trailers=ep.HttpTrailers()),
    ]
    responses = await run(h.service, messages)
    assert kinds(responses)[2:] == ["response_headers", "response_body", "response_body", "response_trailers"]
    echoed = [r.response_body.response.body_mutation.streamed_response for r in responses[3:5]]
    assert [e.body for e in echoed] == sse
    assert h.path.live == 0
    assert h.value("picker_request_ends_total", reason=EndReason.COMPLETED.value) == 1


async def test_streamed_response_is_tracked_to_its_end_here() -> None:
    h = make()
    messages = [
        first(MODE.BUFFERED, MODE.STREAMED),
        body(BODY),
        response_headers(200, A),
        response_chunk(b"data: [DONE]\n\n", False),
        response_chunk(b"", True),
    ]
    responses = await run(h.service, messages)
    assert kinds(responses)[-2:] == ["response_body", "response_body"]
    assert h.path.live == 0 and h.pool.in_flight() == 0


async def test_response_stream_cut_short_ends_as_not_completed() -> None:
    h = make(grace=30)
    messages = [
        first(MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED),
        body(BODY),
        response_headers(200, A),
    ]
    await run(h.service, [*messages, response_chunk(b'data: {"choices":[]}\n\n', False)])
    await async_wait_until(lambda: h.path.live == 0, 3, what="the cut stream to end")
    assert h.value("picker_request_ends_total", reason=EndReason.COMPLETED.value) == 0


# --- client hints, subset hint, conformance hooks -------------------------------------------------


async def test_client_scheduling_headers_are_removed_from_the_routed_request() -> None:
    h = make()
    hints = {headers.FAIRNESS_ID: "tenant-a", headers.PRIORITY: "2"}
    for messages, at in (
        ([first(extra=hints), body(BODY)], 1),
        ([first(MODE.FULL_DUPLEX_STREAMED, extra=hints), body(BODY)], 0),
    ):
        responses = await run(h.service, messages)
        assert set(mutation(responses[at]).remove_headers) == {
            headers.FAIRNESS_ID,
            headers.PRIORITY,
            headers.PREFILLER,
        }


async def test_overlong_fairness_id_is_a_bad_request() -> None:
    h = make(service_options={"max_hint_bytes": 64})
    responses = await run(h.service, [first(extra={headers.FAIRNESS_ID: "f" * 65}), body(BODY)])
    status, sent = reason(responses[-1])
    assert status == 400 and sent[headers.DROPPED_REASON] == "bad-request"
    responses = await run(h.service, [first(extra={headers.FAIRNESS_ID: "f" * 64}), body(BODY)])
    assert destination(responses[-1])


async def test_subset_hint_restricts_the_pick_and_never_to_a_draining_endpoint() -> None:
    h = make()
    h.pool.drain(B)
    for _ in range(10):
        responses = await run(h.service, [first(subset=[B, C]), body(BODY)])
        assert destination(responses[-1]) == [C]


async def test_subset_hint_with_no_eligible_endpoint_is_503_with_retry_after() -> None:
    h = make()
    h.pool.drain(B)
    responses = await run(h.service, [first(subset=[B, "10.9.9.9:1"]), body(BODY)])
    status, sent = reason(responses[-1])
    assert status == 503 and sent[headers.DROPPED_REASON] == "rejected-no-endpoints"
    assert int(sent[headers.RETRY_AFTER]) > 0
    responses = await run(h.service, [first(subset=[]), body(BODY)])
    assert reason(responses[-1])[0] == 503


async def test_conformance_hooks_restrict_and_echo_only_when_enabled() -> None:
    selection = {headers.TEST_ENDPOINT_SELECTION: f"{B}"}
    off = make()
    responses = await run(off.service, [first(extra=selection), body(BODY), response_headers(200, A)])
    assert len(destination(responses[1])) == 3
    assert not responses[-1].response_headers.response.header_mutation.set_headers
    on = make(service_options={"test_hooks": True})
    responses = await run(on.service, [first(extra=selection), body(BODY), response_headers(200, B)])
    assert destination(responses[1]) == [B]
    echoed = responses[-1].response_headers.response.header_mutation.set_headers
    assert [(e.header.key, e.header.raw_value.decode()) for e in echoed] == [
        (headers.TEST_SERVED_ENDPOINT, B)
    ]


# --- the shape without an observer ----------------------------------------------------------------


async def test_without_any_observer_the_engine_gauges_end_requests_not_a_timer() -> None:
    h = make(grace=0.01)
    await run(h.service, [first(), body(BODY), response_headers(200, A)])
    await async_wait_until(
        lambda: h.path.live == 1 and any(r.engine_tracked for r in h.path._live.values()),
        2,
        what="the request to be handed to the engine",
    )
    endpoint = h.pool.get(A)
    assert endpoint is not None and endpoint.in_flight == 1
    record_sample(endpoint, 1, 0, 0.1, time.monotonic())  # the engine still runs it
    h.path.capacity_changed()
    assert h.path.live == 1
    record_sample(endpoint, 0, 0, 0.0, time.monotonic())  # the engine is idle: it ended
    h.path.capacity_changed()
    assert h.path.live == 0 and endpoint.in_flight == 0
    assert h.value("picker_request_ends_total", reason=EndReason.UNOBSERVED.value) == 1


async def test_once_an_observer_attached_a_missing_one_releases_after_the_grace() -> None:
    h = make(grace=0.01)
    await run(h.service, [request_headers({headers.PICKER_REQUEST_ID: "nope"}, observer=True)])
    await run(h.service, [first(), body(BODY), response_headers(200, A)])
    await async_wait_until(lambda: h.path.live == 0, 2, what="the unobserved request to be released")


async def test_engine_shape_stated_in_config_never_waits_for_an_observer() -> None:
    h = make(grace=0.01, service_options={"response_end": ResponseEnd.ENGINE})
    await run(h.service, [request_headers({headers.PICKER_REQUEST_ID: "nope"}, observer=True)])
    await run(h.service, [first(), body(BODY), response_headers(200, A)])
    await async_wait_until(
        lambda: any(r.engine_tracked for r in h.path._live.values()), 2, what="the engine hand-over"
    )


def test_grpc_message_limit_follows_the_body_limit() -> None:
    h = make()
    service: ExtProcService = h.service
    assert service.grpc_message_limit >= 2 * service.max_body_bytes
    assert json.loads(BODY)  # the fixture body is valid JSON


# --- fallback lists only for data planes that can walk them -----------------------------------------


class _Context:
    def __init__(self, *metadata: tuple[str, str], peer: str = "ipv4:127.0.0.1:40000") -> None:
        self._metadata = metadata
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer


async def _destinations(service: ExtProcService, context: object = None) -> list[str]:
    async def feed() -> AsyncIterator[ep.ProcessingRequest]:
        for message in (first(), body(BODY)):
            yield message

    responses = [r async for r in service.Process(feed(), context)]  # type: ignore[arg-type]
    return destination(responses[-1])


async def test_auto_fallbacks_list_one_endpoint_until_the_data_plane_walks_lists() -> None:
    h = make(service_options={"fallbacks": "auto"})
    assert len(await _destinations(h.service)) == 1  # ORIGINAL_DST answers a list with 503
    declared = _Context((headers.DATA_PLANE, headers.OVERRIDE_HOST))
    assert len(await _destinations(h.service, declared)) == 3
    # read on every stream: another filter on the same connection (an ORIGINAL_DST route of the same
    # Envoy) declares nothing and gets one endpoint
    assert len(await _destinations(h.service, _Context())) == 1
    # a data plane that reports the served endpoint (override_host's selected_host_key) walks lists:
    # learned for its own connection only
    walks, other = _Context(peer="ipv4:127.0.0.1:40001"), _Context(peer="ipv4:127.0.0.1:40002")
    assert len(await _destinations(h.service, walks)) == 1

    async def served() -> AsyncIterator[ep.ProcessingRequest]:
        for message in (first(), body(BODY), response_headers(200, A)):
            yield message

    [r async for r in h.service.Process(served(), walks)]  # type: ignore[arg-type]
    assert len(await _destinations(h.service, walks)) == 3
    assert len(await _destinations(h.service, other)) == 1  # an ORIGINAL_DST gateway on the same picker


async def test_fallbacks_never_and_always() -> None:
    never = make(service_options={"fallbacks": "never"})
    declared = _Context((headers.DATA_PLANE, headers.OVERRIDE_HOST))
    assert len(await _destinations(never.service, declared)) == 1
    always = make(service_options={"fallbacks": "always"})
    assert len(await _destinations(always.service)) == 3


async def test_overlong_model_name_is_a_bad_request() -> None:
    h = make(service_options={"max_model_bytes": 32})
    long_model = json.dumps({"model": "m" * 33, "prompt": "hi"}).encode()
    responses = await run(h.service, [first(), body(long_model)])
    status, sent = reason(responses[-1])
    assert status == 400 and sent[headers.DROPPED_REASON] == "bad-request"


async def test_full_duplex_queue_full_is_429_from_the_body_phase() -> None:
    h = make(endpoints=(A,), flow_limits=FlowLimits(max_queued=0), load_policy=LoadPolicy(use_metrics=True))
    record_sample(h.pool.get(A), 10, 10, 0.99, time.monotonic())  # type: ignore[arg-type]
    responses = await run(
        h.service, [first(MODE.FULL_DUPLEX_STREAMED), body(BODY[:5], eos=False), body(BODY[5:])]
    )
    status, sent = reason(responses[-1])
    assert kinds(responses) == ["immediate_response"]
    assert status == 429 and sent[headers.DROPPED_REASON] == "rejected-saturated"


async def test_routing_filter_seeing_bodies_and_an_observer_count_each_chunk_once() -> None:
    h = make(grace=30)
    sse = b'data: {"choices":[{"text":"a"}]}\n\n'
    routing = [first(MODE.BUFFERED, MODE.STREAMED), body(BODY)]
    answers = await run(h.service, routing)  # routed; the stream stays open for the response
    request_id = next(
        s.header.raw_value.decode()
        for s in mutation(answers[-1]).set_headers
        if s.header.key == headers.PICKER_REQUEST_ID
    )
    (record,) = h.path._live.values()
    observer = [
        request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True),
        response_headers(200, A, observer=True),
        ep.ProcessingRequest(response_body=ep.HttpBody(body=sse), observability_mode=True),
    ]
    await run(h.service, observer)
    assert record.tracker is None  # the observer did not attach: the routing stream reports it
