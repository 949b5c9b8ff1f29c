"""Every request is decided by the picker whatever its framing and size (issue 10, items 2, 3 and 9).

Through the real Envoy with the shipped config (request body BUFFERED, request trailers SEND):
- HTTP/2 requests whose body is followed by a trailers HEADERS frame, plain h2c, h1 chunked: all go
  through the picker, so none reaches a drained replica;
- an empty body followed by trailers gets the contract's 400 (no body message ever comes: the
  trailers are the picker's only view of it);
- bodies under `requests.max_body_bytes` (8 MiB) are routed; above it the picker answers 413
  `too-large`; above Envoy's buffer (16 MiB) Envoy answers 413 itself, in the contract's words;
- the client's scheduling headers never reach the model server.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
from aiohttp import web

from loadtest import http_client
from loadtest.procs import free_port, wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import REPLICA_HEADER
from picker.contract import headers

pytestmark = pytest.mark.envoy

_MIB = 1024 * 1024
BODY = json.dumps({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "ignore_eos": True}).encode()


@dataclass
class H2Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""


def h2_post(port: int, body: bytes, *, trailers: bool, timeout: float = 10.0) -> H2Reply:
    """One POST over h2c (prior knowledge); with `trailers`, a trailers HEADERS frame ends the stream."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        request = [
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":scheme", "http"),
            (":authority", "picker-test"),
            ("content-type", "application/json"),
        ]
        conn.send_headers(1, request, end_stream=not body and not trailers)
        if body:
            conn.send_data(1, body, end_stream=not trailers)
        if trailers:
            conn.send_headers(1, [("x-client-trailer", "1")], end_stream=True)
        sock.sendall(conn.data_to_send())
        reply = H2Reply(status=0)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            data = sock.recv(65536)
            if not data:
                break
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    reply.headers = {k.decode(): v.decode() for k, v in event.headers}
                    reply.status = int(reply.headers[":status"])
                elif isinstance(event, h2.events.DataReceived):
                    reply.body += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                    return reply
            sock.sendall(conn.data_to_send())
        raise AssertionError(f"no complete h2 response within {timeout}s (status {reply.status})")
    finally:
        sock.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(tmp_path_factory.mktemp("framing"), StackOptions(replicas=3)).start()
    try:
        yield stack
    finally:
        stack.stop()


def _admin(stack: Stack, address: str, action: str) -> None:
    url = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{address}/{action}"
    http_client.post(url, timeout=5).raise_for_status()


def _contract_reason(status: int, reply_headers: dict[str, str], body: bytes) -> str:
    assert reply_headers.get("content-type", "").startswith("application/json"), reply_headers
    error = json.loads(body)["error"]
    assert error["code"] == status
    assert error["reason"] == reply_headers[headers.DROPPED_REASON]
    return str(error["reason"])


def test_no_framing_lets_a_request_reach_a_drained_replica(stack: Stack) -> None:
    drained = stack.replicas[0]
    before = len(stack.sim_requests(drained))
    _admin(stack, drained, "drain")
    try:
        served: list[str] = []
        for _ in range(12):
            for trailers in (True, False):
                reply = h2_post(stack.listen_port, BODY, trailers=trailers)
                assert reply.status == 200, (trailers, reply)
                served.append(reply.headers[REPLICA_HEADER])
            chunked = http_client.post(
                stack.url + "/v1/completions",
                content=iter([BODY[:9], BODY[9:]]),  # no content-length: h1 chunked
                headers={"content-type": "application/json"},
                timeout=10,
            )
            assert chunked.status_code == 200, chunked.text
            served.append(chunked.headers[REPLICA_HEADER])
        assert drained not in served
        assert set(served) == set(stack.replicas[1:])
        assert len(stack.sim_requests(drained)) == before
    finally:
        _admin(stack, drained, "undrain")
    stack.wait_no_leaks()


def test_empty_body_with_trailers_gets_the_contract_400(stack: Stack) -> None:
    received = sum(len(stack.sim_requests(r)) for r in stack.replicas)
    reply = h2_post(stack.listen_port, b"", trailers=True)
    assert reply.status == 400
    assert _contract_reason(400, reply.headers, reply.body) == "bad-request"
    assert sum(len(stack.sim_requests(r)) for r in stack.replicas) == received


def _sized(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (the padding is a field servers ignore)."""
    head = b'{"model": "tiny-llama", "prompt": "hi", "max_tokens": 1, "user": "'
    return head + b"u" * (size - len(head) - 2) + b'"}'


@pytest.mark.parametrize(
    ("size", "refused_by"),
    [(5 * _MIB, None), (10 * _MIB, "picker"), (20 * _MIB, "envoy")],
    ids=["5MiB-routed", "10MiB-picker-413", "20MiB-envoy-413"],
)
def test_body_size_is_routed_below_the_limit_and_413_above(
    stack: Stack, size: int, refused_by: str | None
) -> None:
    # picker limit 8 MiB (requests.max_body_bytes default); Envoy's buffer 16 MiB (shipped config)
    reply = http_client.post(
        stack.url + "/v1/completions",
        content=_sized(size),
        headers={"content-type": "application/json"},
        timeout=30,
    )
    if refused_by is None:
        assert headers.DROPPED_REASON not in reply.headers, reply.text[:300]
        assert reply.headers.get(REPLICA_HEADER) in stack.replicas, (reply.status_code, reply.text[:300])
        return
    assert reply.status_code == 413, reply.text[:300]
    assert _contract_reason(413, dict(reply.headers), reply.content) == "too-large"


@pytest.fixture
def header_catcher() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """An upstream that records the request headers it gets and answers like a model server."""
    seen: list[dict[str, str]] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        return web.json_response({"choices": [{"text": "ok", "finish_reason": "stop"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    port = free_port()
    runner = web.AppRunner(app)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield f"127.0.0.1:{port}", seen
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_client_scheduling_headers_never_reach_the_model_server(
    tmp_path: Path, header_catcher: tuple[str, list[dict[str, str]]]
) -> None:
    upstream, seen = header_catcher
    options = StackOptions(
        replicas=0,
        picker_endpoints=[upstream],
        extra_envoy_endpoints=[upstream],
        picker_args=("--no-scrape",),
    )
    stack = Stack(tmp_path, options).start()
    try:
        hints = {headers.FAIRNESS_ID: "tenant-a", headers.PRIORITY: "1"}
        for http2 in (False, True):
            with http_client.Client(http1=not http2, http2=http2, timeout=10) as client:
                reply = client.post(stack.url + "/v1/completions", content=BODY, headers=hints)
            assert reply.status_code == 200, reply.text
        wait_until(lambda: len(seen) == 2, 5, what="both requests at the upstream")
        for got in seen:
            assert headers.FAIRNESS_ID not in got and headers.PRIORITY not in got, got
            assert got[headers.DESTINATION] == upstream
        long_id = {headers.FAIRNESS_ID: "f" * 10_000}
        reply = http_client.post(stack.url + "/v1/completions", content=BODY, headers=long_id, timeout=10)
        assert reply.status_code == 400
        assert _contract_reason(400, dict(reply.headers), reply.content) == "bad-request"
        assert len(seen) == 2
    finally:
        stack.stop()


# --- the same guarantees behind gateway-shaped configs (config/gateways/, see tests/envoy/test_gateways.py)


@pytest.mark.parametrize("shape", ["eg-buffered", "aigw-failopen", "aigw-failclose"])
def test_gateway_shapes_decide_every_framing(tmp_path: Path, shape: str) -> None:
    """BUFFERED (trailers SKIP) and FULL_DUPLEX (trailers SEND) shapes: no framing skips the picker.

    In FULL_DUPLEX a body followed by trailers is refused with the contract's 400: Envoy 1.40 sends
    the model server such a body twice once the picker has echoed it (measured).
    """
    stack = Stack(tmp_path, StackOptions(replicas=3, shape=shape)).start()
    try:
        drained = stack.replicas[0]
        _admin(stack, drained, "drain")
        full_duplex = shape.startswith("aigw")
        served: list[str] = []
        for _ in range(6):
            reply = h2_post(stack.listen_port, BODY, trailers=True)
            if full_duplex:
                assert reply.status == 400
                assert _contract_reason(400, reply.headers, reply.body) == "bad-request"
            else:
                assert reply.status == 200, reply
                served.append(reply.headers[REPLICA_HEADER])
            reply = h2_post(stack.listen_port, BODY, trailers=False)
            assert reply.status == 200, reply
            served.append(reply.headers[REPLICA_HEADER])
            chunked = http_client.post(
                stack.url + "/v1/completions",
                content=iter([BODY[:9], BODY[9:]]),
                headers={"content-type": "application/json"},
                timeout=10,
            )
            assert chunked.status_code == 200, chunked.text
            served.append(chunked.headers[REPLICA_HEADER])
        assert drained not in served and len(stack.sim_requests(drained)) == 0
        stack.wait_no_leaks()
    finally:
        stack.stop()


def test_without_an_observer_a_long_stream_keeps_its_slot(tmp_path: Path) -> None:
    """Response bodies NONE and no observer (Envoy Gateway's example): the grace timer releases nothing;
    the engine's scraped gauges end the request once its engine no longer runs it."""
    options = StackOptions(replicas=1, shape="eg-buffered", sim_args=("--ttft-ms", "20", "--itl-ms", "50"))
    stack = Stack(tmp_path, options).start()
    body = {"model": "tiny-llama", "prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
    try:
        with (
            http_client.Client(timeout=30) as client,
            client.stream("POST", stack.url + "/v1/completions", json=body) as response,
        ):
            assert response.status_code == 200
            events = 0
            started = time.monotonic()
            lines = response.iter_lines()  # kept: a generator closed by `break` would close the stream
            for line in lines:
                events += line.startswith("data:")
                # twice the observer grace (2 s) into a 6 s stream: a timer would have released it
                if time.monotonic() - started > 4.0:
                    break
            assert events > 10
            assert stack.picker_value("picker_in_flight") == 1
            assert "releasing its slot" not in stack.picker.log_text()  # type: ignore[union-attr]
            assert sum(line.startswith("data:") for line in lines) > 0  # the stream goes on to its end
        stack.wait_no_leaks()  # the stream ended: its engine's gauges ended the request
    finally:
        stack.stop()


@pytest.mark.parametrize(("fallbacks", "status"), [("auto", 200), ("always", 503)])
def test_original_dst_gateway_needs_the_primary_alone(tmp_path: Path, fallbacks: str, status: int) -> None:
    """Envoy AI Gateway's FailClose pool (ORIGINAL_DST on the destination header) answers a list with
    503 `no_healthy_upstream`: the default (`--fallbacks auto`) sends it the primary alone."""
    options = StackOptions(replicas=2, shape="aigw-failclose", picker_args=("--fallbacks", fallbacks))
    stack = Stack(tmp_path, options).start()
    try:
        for _ in range(3):
            reply = http_client.post(stack.url + "/v1/completions", content=BODY, timeout=10)
            assert reply.status_code == status, reply.text[:200]
            assert headers.DROPPED_REASON not in reply.headers  # Envoy's answer, not the picker's
        stack.wait_no_leaks()
    finally:
        stack.stop()
