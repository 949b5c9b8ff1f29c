"""The ext_proc adapter driven with in-memory protobuf streams (no Envoy, no network)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Sequence

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf import struct_pb2

from loadtest.procs import async_wait_until
from picker.contract import headers
from picker.extproc.service import ExtProcService, ResponseEnd
from picker.flow import FlowLimits
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.streams import Attempts, EndReason


class Harness:
    def __init__(
        self,
        endpoints: Sequence[str],
        grace: float,
        service_options: dict[str, object] | None = None,
        **path_options: object,
    ) -> None:
        self.pool = Pool()
        self.pool.apply(ready=endpoints)
        self.metrics = Metrics(pool="default")
        self.metrics.register_pool(self.pool)
        self.path = RequestPath(self.pool, self.metrics, fallback_count=2, **path_options)  # type: ignore[arg-type]
        self.service = ExtProcService(
            self.path,
            max_body_bytes=4096,
            observer_attach_grace_s=grace,
            **{"fallbacks": "always", **(service_options or {})},  # type: ignore[arg-type]
        )

    def value(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


def make(
    endpoints: Sequence[str] = ("10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"),
    grace: float = 0.05,
    service_options: dict[str, object] | None = None,
    **path_options: object,
) -> Harness:
    return Harness(endpoints, grace, service_options, **path_options)


def hdrs(pairs: dict[str, str], eos: bool = False) -> ep.HttpHeaders:
    return ep.HttpHeaders(
        headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
        ),
        end_of_stream=eos,
    )


def request_headers(
    extra: dict[str, str] | None = None, eos: bool = False, method: str = "POST", observer: bool = False
) -> ep.ProcessingRequest:
    pairs = {
        ":method": method,
        ":path": "/v1/completions",
        "content-type": "application/json",
        **(extra or {}),
    }
    return ep.ProcessingRequest(request_headers=hdrs(pairs, eos), observability_mode=observer)


def body(data: bytes, eos: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


def response_headers(
    status: int = 200, served: str | None = None, eos: bool = False, observer: bool = False
) -> ep.ProcessingRequest:
    request = ep.ProcessingRequest(
        response_headers=hdrs({":status": str(status)}, eos), observability_mode=observer
    )
    if served:
        meta = struct_pb2.Struct()
        meta.update({headers.DESTINATION_SERVED: served})
        request.metadata_context.filter_metadata[headers.LB_METADATA_NAMESPACE].CopyFrom(meta)
    return request


def response_body(eos: bool) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(
        response_body=ep.HttpBody(body=b"data: {}\n\n", end_of_stream=eos), observability_mode=True
    )


async def feed(messages: Sequence[ep.ProcessingRequest]) -> AsyncIterator[ep.ProcessingRequest]:
    for message in messages:
        yield message


async def run(
    service: ExtProcService, messages: Sequence[ep.ProcessingRequest]
) -> list[ep.ProcessingResponse]:
    return [r async for r in service.Process(feed(messages), None)]  # type: ignore[arg-type]


def routed(responses: list[ep.ProcessingResponse]) -> tuple[list[str], str]:
    reply = responses[-1]
    lb = reply.dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE].struct_value
    destinations = lb.fields[headers.DESTINATION].string_value.split(",")
    mutation = reply.request_body.response.header_mutation
    set_headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert set_headers[headers.DESTINATION] == ",".join(destinations)
    return destinations, set_headers[headers.PICKER_REQUEST_ID]


BODY = json.dumps({"model": "m", "prompt": "hi", "stream": True}).encode()


async def test_routes_in_the_body_phase_with_primary_and_two_fallbacks() -> None:
    h = make()
    responses = await run(h.service, [request_headers(), body(BODY)])
    assert responses[0].WhichOneof("response") == "request_headers"
    destinations, request_id = routed(responses)
    assert len(destinations) == 3 and len(set(destinations)) == 3
    assert request_id


async def test_forged_destination_header_is_ignored() -> None:
    h = make(endpoints=("10.0.0.1:8000",))
    responses = await run(h.service, [request_headers({headers.DESTINATION: "6.6.6.6:1"}), body(BODY)])
    assert routed(responses)[0] == ["10.0.0.1:8000"]


async def test_observer_owns_the_end_and_releases_exactly_once() -> None:
    h = make()
    route = await run(h.service, [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")])
    _, request_id = routed(route[:2])
    pool = h.pool
    assert h.path.live == 1  # routing stream ended; the observer will report the end
    assert pool.get("10.0.0.2:8000").in_flight == 1  # type: ignore[union-attr]
    observer = [
        request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True),
        response_headers(200, "10.0.0.2:8000", observer=True),
        response_body(False),
    ]
    await run(h.service, [*observer, response_body(True)])
    assert h.path.live == 0 and pool.in_flight() == 0
    assert h.value("picker_request_ends_total", reason="completed") == 1


async def test_in_flight_follows_the_served_endpoint_while_streaming() -> None:
    h = make()
    route = await run(h.service, [request_headers(), body(BODY), response_headers(200, "10.0.0.3:8000")])
    _, request_id = routed(route[:2])
    pool = h.pool
    assert pool.get("10.0.0.3:8000").in_flight == 1  # type: ignore[union-attr]
    await run(
        h.service,
        [request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True), response_body(False)],
    )
    # cut short: only Envoy's access log can say by whom, so the request stays counted until it does
    assert pool.in_flight() == 1
    h.path.access_logged(request_id, Attempts(flags=frozenset({"downstream_remote_reset"}), status=200))
    assert pool.in_flight() == 0
    assert h.value("picker_request_ends_total", reason=EndReason.CLIENT_DISCONNECT.value) == 1


async def test_access_log_alone_ends_a_request_without_observer() -> None:
    h = make(grace=30)
    route = await run(h.service, [request_headers(), body(BODY), response_headers(503, "10.0.0.1:8000")])
    _, request_id = routed(route[:2])
    h.path.access_logged(
        request_id, Attempts(count=3, status=503, flags=frozenset({"upstream_remote_reset"}))
    )
    assert h.pool.in_flight() == 0
    assert h.value("picker_request_ends_total", reason=EndReason.UPSTREAM_ERROR_STATUS.value) == 1
    assert h.value("picker_upstream_retries_total", endpoint="10.0.0.1:8000") == 2


async def test_unobserved_request_is_released_after_the_grace() -> None:
    # the observer shape: a request no observer claims is released (its filter is missing)
    h = make(grace=0.01, service_options={"response_end": ResponseEnd.OBSERVER})
    await run(h.service, [request_headers(), body(BODY), response_headers(200)])
    assert h.path.live == 1
    await async_wait_until(lambda: h.path.live == 0, 2, what="the unobserved request to expire")
    assert h.path.live == 0 and h.path._pool.in_flight() == 0


async def test_get_without_body_routes_in_the_headers_phase() -> None:
    h = make()
    responses = await run(h.service, [request_headers(method="GET", eos=True)])
    assert responses[0].WhichOneof("response") == "request_headers"
    assert (
        responses[0]
        .dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE]
        .struct_value.fields[headers.DESTINATION]
        .string_value
    )


async def test_bad_body_is_an_immediate_400_with_reason() -> None:
    h = make()
    responses = await run(h.service, [request_headers(), body(b"{oops")])
    immediate = responses[-1].immediate_response
    assert immediate.status.code == 400
    assert {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}[
        headers.DROPPED_REASON
    ] == "bad-request"
    assert json.loads(immediate.body)["error"]["code"] == 400
    assert h.path.live == 0


async def test_body_over_the_limit_is_413_even_when_streamed_in_pieces() -> None:
    h = make()
    responses = await run(h.service, [request_headers(), body(b"x" * 3000, eos=False), body(b"x" * 3000)])
    assert responses[-1].immediate_response.status.code == 413


async def test_no_ready_endpoint_is_503_at_once_when_configured() -> None:
    h = make(endpoints=(), reject_without_endpoints=True)
    responses = await run(h.service, [request_headers(), body(BODY)])
    assert len(responses) == 2  # no timeout extension: nothing was queued
    immediate = responses[-1].immediate_response
    assert immediate.status.code == 503
    assert "rejected-no-endpoints" in immediate.body.decode()


async def test_no_ready_endpoint_waits_then_503_after_its_ttl() -> None:
    h = make(endpoints=(), flow_limits=FlowLimits(ttl_s=0.05))
    h.service.queue_wait_s = 1.5
    responses = await run(h.service, [request_headers(), body(BODY)])
    assert responses[1].override_message_timeout.ToNanoseconds() == 1_500_000_000
    assert responses[2].immediate_response.status.code == 503
    assert h.value("picker_requests_total", outcome="rejected-no-endpoints") == 1


async def test_saturated_pool_queues_until_a_slot_frees() -> None:
    h = make(("10.0.0.1:8000",), grace=30, load_policy=LoadPolicy(engine_slots=1, staleness_s=1e9))
    endpoint = h.pool.get("10.0.0.1:8000")
    assert endpoint is not None
    record_sample(endpoint, running=0, waiting=0, kv_usage=0.0, now=0.0)
    _, first_id = routed(await run(h.service, [request_headers(), body(BODY)]))
    routed(await run(h.service, [request_headers(), body(BODY)]))  # waits on the engine (threshold 1)
    # the engine's slot and its allowed queue are taken: the next one waits in the picker instead
    second = asyncio.create_task(run(h.service, [request_headers(), body(BODY)]))
    await async_wait_until(lambda: h.path.flow.queued == 1, 2, what="the second request to queue")
    assert not second.done()
    await run(
        h.service,
        [request_headers({headers.PICKER_REQUEST_ID: first_id}, observer=True), response_body(True)],
    )
    responses = await asyncio.wait_for(second, 2)
    assert responses[1].HasField("override_message_timeout")
    routed(responses)
    assert h.path.flow.queued == 0


async def test_client_gone_while_queued_frees_the_place_and_is_counted() -> None:
    h = make(endpoints=())

    async def hang_after_body() -> AsyncIterator[ep.ProcessingRequest]:
        yield request_headers()
        yield body(BODY)
        await asyncio.Event().wait()

    async def consume() -> None:
        async for _ in h.service.Process(hang_after_body(), None):  # type: ignore[arg-type]
            pass

    task = asyncio.create_task(consume())
    await async_wait_until(lambda: h.path.flow.queued == 1, 2, what="the request to queue")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert h.path.flow.queued == 0
    assert h.value("picker_requests_total", outcome="rejected-context-cancelled") == 1
    assert h.value("picker_request_ends_total", reason="rejected") == 1


async def test_non_integer_priority_is_a_bad_request() -> None:
    h = make()
    responses = await run(h.service, [request_headers({headers.PRIORITY: "high"}), body(BODY)])
    assert responses[-1].immediate_response.status.code == 400


async def test_unknown_observer_is_counted_not_fatal() -> None:
    h = make()
    await run(
        h.service, [request_headers({headers.PICKER_REQUEST_ID: "nope"}, observer=True), response_body(True)]
    )
    assert h.value("picker_observer_unmatched_total") == 1


async def pulled_from(service: ExtProcService, messages: Sequence[ep.ProcessingRequest]) -> int:
    """How many messages the service read before it ended the RPC itself."""
    return (await counted(service, messages))[0]


async def test_observer_ends_its_rpc_at_the_response_end() -> None:
    # grpc.aio leaks native memory for every RPC the client resets before the server's status
    # (grpc/grpc#43360); Envoy resets the observer's stream when it closes it, so the picker ends it
    # first, right after the last message it needs (README, "Benchmarks": the soak).
    h = make()
    route = await run(h.service, [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")])
    _, request_id = routed(route[:2])
    observer = [
        request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True),
        response_headers(200, "10.0.0.2:8000", observer=True),
        response_body(False),
        response_body(True),
        response_body(False),  # never read: the RPC has ended
    ]
    assert await pulled_from(h.service, observer) == 4
    assert h.path.live == 0
    assert h.value("picker_request_ends_total", reason="completed") == 1
    unknown = [request_headers({headers.PICKER_REQUEST_ID: "nope"}, observer=True), response_body(True)]
    assert await pulled_from(h.service, unknown) == 1
    assert h.service.open_streams == 0


async def test_stream_cancelled_mid_routing_releases_nothing_twice() -> None:
    h = make()

    async def hang() -> AsyncIterator[ep.ProcessingRequest]:
        yield request_headers()
        yield body(BODY)
        await asyncio.Event().wait()

    async def consume() -> None:
        async for _ in h.service.Process(hang(), None):  # type: ignore[arg-type]
            pass

    task = asyncio.create_task(consume())
    await async_wait_until(lambda: h.path.live == 1, 2, what="the request to be routed")
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert h.service.open_streams == 0


class Peer:
    """The part of grpc.aio's ServicerContext the service reads: which connection a stream came on."""

    def __init__(self, peer: str) -> None:
        self._peer = peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((headers.DATA_PLANE, headers.OVERRIDE_HOST),)


async def counted(
    service: ExtProcService, messages: Sequence[ep.ProcessingRequest], context: Peer | None = None
) -> tuple[int, list[ep.ProcessingResponse]]:
    """How many messages the service read before it ended the RPC, and what it answered."""
    pulled = 0

    async def counting() -> AsyncIterator[ep.ProcessingRequest]:
        nonlocal pulled
        for message in messages:
            pulled += 1
            yield message

    out = [r async for r in service.Process(counting(), context)]  # type: ignore[arg-type]
    return pulled, out


async def observe(h: Harness, request_id: str, served: str, context: Peer) -> None:
    observer = [
        request_headers({headers.PICKER_REQUEST_ID: request_id}, observer=True),
        response_headers(200, served, observer=True),
        response_body(True),
    ]
    assert (await counted(h.service, observer, context))[0] == 3


async def test_routing_ends_at_its_decision_on_a_connection_whose_observer_reports() -> None:
    # Response headers that go to the picker wait for its answer (one more round trip before the
    # first token): where an observer stream reports them, the routing stream ends once it routed.
    h = make()
    envoy = Peer("ipv4:127.0.0.1:40000")
    first = [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")]
    pulled, answers = await counted(h.service, first, envoy)
    assert pulled == 3  # no observer seen on this connection yet: the routing stream reports
    await observe(h, routed(answers[:2])[1], "10.0.0.2:8000", envoy)

    fallbacks_served = h.value("picker_fallback_served_total")
    second = [request_headers(), body(BODY), response_headers(200, "10.0.0.3:8000")]
    pulled, answers = await counted(h.service, second, envoy)
    assert pulled == 2 and len(answers) == 2  # headers continued, body routed; then the RPC ended
    destinations, request_id = routed(answers)
    assert h.path.live == 1
    # Envoy served it from the first fallback: the observer's response headers say so
    await observe(h, request_id, destinations[1], envoy)
    assert h.path.live == 0
    assert h.value("picker_request_ends_total", reason="completed") == 2
    assert h.value("picker_fallback_served_total") == fallbacks_served + 1

    # another data plane's connection, with no observer filter, keeps its response headers
    other = Peer("ipv4:127.0.0.1:40001")
    pulled, _ = await counted(h.service, second, other)
    assert pulled == 3


async def test_a_request_routed_at_the_answer_that_no_observer_claims_was_left_by_its_client() -> None:
    # The routing stream ended at its answer, then no observer stream came: Envoy never acted on the
    # answer (the client had gone), so the grace releases the slot as a client disconnect.
    h = make(service_options={"response_end": ResponseEnd.OBSERVER})
    envoy = Peer("p")
    first = [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")]
    _, answers = await counted(h.service, first, envoy)
    await observe(h, routed(answers[:2])[1], "10.0.0.2:8000", envoy)
    pulled, answers = await counted(h.service, [request_headers(), body(BODY)], envoy)
    assert pulled == 2 and routed(answers)
    assert h.path.live == 1
    await async_wait_until(lambda: h.path.live == 0, 2, what="the grace to release the slot")
    assert h.value("picker_request_ends_total", reason="client-disconnect") == 1
    assert h.value("picker_request_ends_total", reason="unobserved") == 0


async def test_without_an_observer_on_its_connection_the_routing_stream_waits_for_the_response() -> None:
    # `observer` stated, but no observer stream came on this connection (the filter is missing):
    # the routing stream still reports the response, so its start and who served are known.
    h = make(service_options={"response_end": ResponseEnd.OBSERVER})
    pulled, _ = await counted(
        h.service, [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")], Peer("p")
    )
    assert pulled == 3


async def test_test_hooks_keep_the_routing_stream_to_the_response_headers() -> None:
    h = make(service_options={"response_end": ResponseEnd.OBSERVER, "test_hooks": True})
    pulled, answers = await counted(
        h.service, [request_headers(), body(BODY), response_headers(200, "10.0.0.2:8000")], Peer("p")
    )
    assert pulled == 3
    mutation = answers[-1].response_headers.response.header_mutation
    assert headers.TEST_SERVED_ENDPOINT in {h.header.key for h in mutation.set_headers}
