"""What only the proxy does on the wire: its own headers, bodies it must not read, garbage, pipelining."""

from __future__ import annotations

import asyncio
import json

from loadtest import http_client
from loadtest.proxy_stack import ProxyStack
from loadtest.traffic import REPLICA_HEADER, completion_body, stream_one
from tests.proxy.conftest import LIMIT


async def raw_exchange(port: int, payload: bytes, *, until: bytes, limit: int = 1 << 20) -> bytes:
    """Send raw bytes, read until `until` has been seen (or the server closes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        received = b""
        async with asyncio.timeout(10):
            while until not in received and len(received) < limit:
                chunk = await reader.read(65536)
                if not chunk:
                    break
                received += chunk
        return received
    finally:
        writer.close()


def request_bytes(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


async def test_response_names_who_served_and_the_request_id(proxy: ProxyStack) -> None:
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.post(
            proxy.url + "/v1/completions",
            json=completion_body(2, stream=False),
            headers={"te": "trailers", "x-gateway-inference-priority": "1"},
        )
    assert response.status_code == 200
    assert response.headers["x-gateway-destination-endpoint-served"] == response.headers[REPLICA_HEADER]
    assert len(response.headers["x-picker-request-id"]) == 32
    assert "transfer-encoding" not in response.headers or response.headers["transfer-encoding"] == "chunked"
    proxy.wait_no_leaks()


async def test_models_are_answered_by_a_ready_endpoint(proxy: ProxyStack) -> None:
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.get(proxy.url + "/v1/models")
    assert response.status_code == 200 and response.json()["data"][0]["id"]
    assert response.headers[REPLICA_HEADER] in proxy.replicas


async def test_oversized_body_is_refused_unread_and_the_proxy_keeps_serving(proxy: ProxyStack) -> None:
    # Declared too large: refused from the headers alone, never read.
    head = request_bytes(b"")[: -len(b"content-length: 0\r\n\r\n")] + b"content-length: %d\r\n\r\n" % (
        100 * LIMIT
    )
    answer = await raw_exchange(proxy.listen_port, head + b"{" * 1024, until=b"}}")
    assert answer.startswith(b"HTTP/1.1 413")
    assert b"x-picker-dropped-reason: too-large" in answer.lower()

    # Chunked, no length: refused as soon as it passes the limit.
    async def chunks():
        for _ in range(100):
            yield b"x" * 4096

    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.post(
            proxy.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert response.status_code == 413 and response.json()["error"]["reason"] == "too-large"
        assert (await stream_one(client, proxy.url, completion_body(2))).ok
    proxy.wait_no_leaks()


async def test_garbage_gets_a_400_and_the_proxy_keeps_serving(proxy: ProxyStack) -> None:
    for garbage in (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 64, b"HELLO THERE\r\n\r\n"):
        answer = await raw_exchange(proxy.listen_port, garbage, until=b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 400") or answer.startswith(b"HTTP/1.0 400"), answer[:80]
    bad_header = await raw_exchange(
        proxy.listen_port, request_bytes(b"{}", b"x-gateway-inference-priority: high\r\n"), until=b"}}"
    )
    assert bad_header.startswith(b"HTTP/1.1 400") and b"bad-request" in bad_header
    async with http_client.AsyncClient(timeout=10) as client:
        assert (await stream_one(client, proxy.url, completion_body(2))).ok
    proxy.wait_no_leaks()


async def test_pipelined_requests_are_answered_in_order(proxy: ProxyStack) -> None:
    bodies = [json.dumps(completion_body(n, stream=False)).encode() for n in (3, 1, 2)]
    payload = b"".join(request_bytes(body) for body in bodies)
    # one write, three requests: read until three complete JSON bodies have come back
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.listen_port)
    try:
        writer.write(payload)
        await writer.drain()
        answer = b""
        async with asyncio.timeout(10):
            while answer.count(b'"completion_tokens"') < 3:
                chunk = await reader.read(65536)
                assert chunk, answer
                answer += chunk
    finally:
        writer.close()
    assert answer.count(b"HTTP/1.1 200") == 3
    counts = [int(part.split(b",", 1)[0]) for part in answer.split(b'"completion_tokens":')[1:]]
    assert counts == [3, 1, 2]
    proxy.wait_no_leaks()


async def test_oversized_hint_header_is_a_400(proxy: ProxyStack) -> None:
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.post(
            proxy.url + "/v1/completions",
            json=completion_body(2, stream=False),
            headers={"x-gateway-inference-fairness-id": "f" * 300},
        )
    assert response.status_code == 400 and response.headers["x-picker-dropped-reason"] == "bad-request"
    assert "longer than" in response.json()["error"]["message"]
