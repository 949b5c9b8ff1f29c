"""h2c (HTTP/2 cleartext, prior knowledge) on the proxy's port: the same answers as HTTP/1.1, many
streams on one connection, and a reset stream aborts its engine request without touching the others."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
from h2.config import H2Configuration
from h2.connection import H2Connection

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions
from loadtest.traffic import REPLICA_HEADER, completion_body, stream_one
from tests.proxy.conftest import LIMIT

ABORTED_WITHIN_S = 2.0  # the aborted stream would run 20 s; only a missing abort misses this


def h2_client() -> httpx.AsyncClient:
    return http_client.AsyncClient(http1=False, http2=True, timeout=10)


async def test_requests_and_streams_over_one_h2c_connection(proxy: ProxyStack) -> None:
    async with h2_client() as client:
        response = await client.post(proxy.url + "/v1/completions", json=completion_body(3, stream=False))
        assert response.http_version == "HTTP/2" and response.status_code == 200
        assert response.headers["x-gateway-destination-endpoint-served"] == response.headers[REPLICA_HEADER]
        assert response.json()["usage"]["completion_tokens"] == 3
        results = await asyncio.gather(
            *(stream_one(client, proxy.url, completion_body(10)) for _ in range(64))
        )
        assert [r for r in results if not r.ok] == []
        assert {r.replica for r in results} == set(proxy.replicas)
        models = await client.get(proxy.url + "/v1/models")
        assert models.status_code == 200 and models.json()["data"]
    proxy.wait_no_leaks()


async def test_contract_replies_over_h2c(proxy: ProxyStack) -> None:
    async with h2_client() as client:
        bad = await client.post(proxy.url + "/v1/completions", content=b"{nope")
        big = await client.post(
            proxy.url + "/v1/completions",
            content=b"x" * (LIMIT + 1),
            headers={"content-type": "application/json"},
        )
    assert (bad.status_code, bad.headers["x-picker-dropped-reason"]) == (400, "bad-request")
    assert (big.status_code, big.headers["x-picker-dropped-reason"]) == (413, "too-large")
    assert bad.json()["error"]["code"] == 400 and big.json()["error"]["code"] == 413
    proxy.wait_no_leaks()


async def test_a_reset_stream_aborts_its_engine_request_only(proxy: ProxyStack) -> None:
    before = proxy.picker_value("picker_request_ends_total", reason="client-disconnect")
    started = time.time()
    async with h2_client() as client:
        neighbour = asyncio.create_task(  # a non-streaming neighbour on the same connection
            client.post(proxy.url + "/v1/completions", json=completion_body(60, stream=False))
        )
        async with client.stream(
            "POST", proxy.url + "/v1/completions", json=completion_body(2000)
        ) as response:
            assert response.http_version == "HTTP/2"
            replica = response.headers[REPLICA_HEADER]
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
        gone_at = time.time()  # leaving the block resets the stream (RST_STREAM), not the connection
        kept = await neighbour
    assert kept.status_code == 200 and kept.json()["usage"]["completion_tokens"] == 60

    def long_one() -> dict[str, object]:
        return next(e for e in proxy.sim_requests(replica) if e["stream"] and e["arrival"] >= started)

    await asyncio.to_thread(wait_until, lambda: long_one()["end"] is not None, 5)
    entry = long_one()
    assert entry["outcome"] == "aborted" and entry["end"] - gone_at < ABORTED_WITHIN_S  # type: ignore[operator]
    await asyncio.to_thread(
        wait_until,
        lambda: proxy.picker_value("picker_request_ends_total", reason="client-disconnect") == before + 1,
        5,
    )
    proxy.wait_no_leaks()


async def test_broken_frames_after_the_preface_close_only_that_connection(proxy: ProxyStack) -> None:
    with socket.create_connection(("127.0.0.1", proxy.listen_port), timeout=5) as sock:
        settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
        data_on_stream_zero = b"\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00"  # a PROTOCOL_ERROR
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + settings + data_on_stream_zero)
        received = b""
        while chunk := sock.recv(65536):  # the server answers (SETTINGS, GOAWAY) and closes
            received += chunk
    assert b"\x07\x00\x00\x00\x00\x00" in received  # a GOAWAY frame (type 7) before the close
    async with h2_client() as client:
        assert (await stream_one(client, proxy.url, completion_body(2))).ok
    proxy.wait_no_leaks()


async def test_a_client_that_never_opens_its_window_holds_back_its_upstream(tmp_path: Path) -> None:
    # The HTTP/2 twin of the HTTP/1.1 slow-client test: ~56 MB offered, the client grants 64 KiB.
    sim = ("--ttft-ms", "1", "--itl-ms", "0.01", "--tokens-per-chunk", "64", "--max-model-len", "100000000")
    sim += ("--kv-capacity-tokens", "100000000")
    stack = ProxyStack(tmp_path, StackOptions(replicas=1, sim_args=sim, picker_args=("--no-scrape",))).start()
    total = 8_000_000
    try:
        (replica,) = stack.replicas
        conn = H2Connection(H2Configuration(client_side=True))
        conn.initiate_connection()
        body = json.dumps(completion_body(total)).encode()
        request = [
            (":method", "POST"),
            (":path", "/v1/completions"),
            (":scheme", "http"),
            (":authority", "t"),
            ("content-type", "application/json"),
        ]
        conn.send_headers(1, request)
        conn.send_data(1, body, end_stream=True)
        with socket.create_connection(("127.0.0.1", stack.listen_port), timeout=5) as sock:
            sock.sendall(conn.data_to_send())  # and never a WINDOW_UPDATE: the client reads nothing
            sent: list[int] = []

            def settled() -> bool:
                entries = stack.sim_requests(replica)
                sent.append(entries[-1]["tokens_sent"] if entries else 0)
                return len(sent) >= 5 and sent[-1] > 0 and sent[-1] == sent[-5]

            await asyncio.to_thread(wait_until, settled, 40, 0.2, "the upstream to stop sending")
            entry = stack.sim_requests(replica)[-1]
            assert entry["end"] is None and entry["tokens_sent"] < total // 4, entry
        await asyncio.to_thread(
            wait_until, lambda: stack.sim_requests(replica)[-1]["outcome"] == "aborted", 5
        )
        stack.wait_no_leaks()
    finally:
        stack.stop()
