"""Fault injection, per request (x-sim-fault) and server-wide (--fault, POST/DELETE /sim/faults)."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import parity_checks as pc
import pytest
from simkit import fast_config, sim_requests
from vllm_sim import Replica, parse_fault_header, run_sim
from vllm_sim.faults import FaultBoard, MidStreamFault

from loadtest import http_client
from loadtest.sse_client import stream_request

STREAM = {"prompt": "x", "max_tokens": 20, "ignore_eos": True, "stream": True}


def test_fault_header_grammar() -> None:
    spec = parse_fault_header("slow-headers=100, reset_after=5")
    assert spec.slow_headers_ms == 100 and spec.mid_stream is MidStreamFault.RESET and spec.after_tokens == 5
    assert parse_fault_header("status=429").describe() == {"status": 429}
    for bad in ("status=200", "reset-after=-1", "nope=1", "status", "", "error-after=1;stall-after=2"):
        with pytest.raises(ValueError):
            parse_fault_header(bad)


def test_fault_board_counts_down() -> None:
    board = FaultBoard()
    board.set(parse_fault_header("status=503"), count=2)
    assert [board.take() is not None for _ in range(3)] == [True, True, False]


@pytest.mark.parametrize(
    ("status", "error_type", "message_part"),
    [
        (503, "Service Unavailable", "currently busy"),
        (500, "InternalServerError", "EngineCore"),
        (429, "Too Many Requests", ""),
    ],
)
async def test_status_fault_before_any_token(
    client: httpx.AsyncClient, status: int, error_type: str, message_part: str
) -> None:
    response = await client.post("/v1/completions", json=STREAM, headers={"x-sim-fault": f"status={status}"})
    pc.check_error(response, status, error_type, message_part)


async def test_error_after_n_tokens_sends_vllms_error_event_then_done(
    sim: Replica, client: httpx.AsyncClient
) -> None:
    result = await stream_request(
        client, "/v1/completions", STREAM, headers={"x-sim-fault": "error-after=3", "x-request-id": "e"}
    )
    assert result.status == 200 and result.end == "done"
    assert len(result.content_chunks) == 3 and result.finish_reason is None
    assert result.raw.endswith(
        b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace (above) for the root '
        b'cause.", "type": "InternalServerError", "param": null, "code": 500}}\n\ndata: [DONE]\n\n'
    )
    (entry,) = await sim_requests(sim.url, "e")
    assert entry["outcome"] == "error" and entry["tokens_sent"] == 3


async def test_error_fault_non_streaming_is_500(client: httpx.AsyncClient) -> None:
    body = {**STREAM, "stream": False}
    response = await client.post("/v1/completions", json=body, headers={"x-sim-fault": "error-after=2"})
    pc.check_error(response, 500, "InternalServerError", "EngineCore")


async def test_reset_after_n_tokens_is_a_tcp_reset(sim: Replica) -> None:
    """Raw socket: after 2 token frames the server's RST surfaces as ConnectionResetError, not EOF."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sim.port)
    body = json.dumps(STREAM).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
        b"x-sim-fault: reset-after=2\r\nx-request-id: r\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    received = b""
    with pytest.raises(ConnectionResetError):
        while chunk := await asyncio.wait_for(reader.read(65536), 5):
            received += chunk
    writer.close()
    assert received.count(b"data: ") == 2 and b"[DONE]" not in received
    (entry,) = await sim_requests(sim.url, "r")
    assert entry["outcome"] == "reset" and entry["tokens_sent"] == 2


async def test_reset_is_a_transport_error_for_http_clients(client: httpx.AsyncClient) -> None:
    result = await stream_request(client, "/v1/completions", STREAM, headers={"x-sim-fault": "reset-after=4"})
    assert result.end == "error" and len(result.content_chunks) == 4


async def test_stall_keeps_connection_and_slot_until_the_client_leaves(
    sim: Replica, client: httpx.AsyncClient
) -> None:
    result = await stream_request(
        client,
        "/v1/completions",
        STREAM,
        headers={"x-sim-fault": "stall-after=2", "x-request-id": "st"},
        read_timeout=0.3,
    )
    assert result.end == "timeout" and len(result.content_chunks) == 2
    assert await pc.wait_until(lambda: not sim.state.engine.running, 2), "slot kept after the client left"
    (entry,) = await sim_requests(sim.url, "st")
    assert entry["outcome"] == "stalled"


async def test_fault_beyond_the_last_token_strikes_before_usage_and_done(client: httpx.AsyncClient) -> None:
    body = {**STREAM, "max_tokens": 3, "stream_options": {"include_usage": True}}
    result = await stream_request(client, "/v1/completions", body, headers={"x-sim-fault": "reset-after=3"})
    assert (
        result.end == "error"
        and result.finish_reason == "length"
        and result.usage is None
        and not result.done
    )


async def test_slow_headers_delays_the_response_headers(client: httpx.AsyncClient) -> None:
    result = await stream_request(
        client, "/v1/completions", STREAM, headers={"x-sim-fault": "slow-headers=150"}
    )
    assert result.t_headers is not None and result.t_headers >= 0.15 and result.end == "done"


async def test_server_wide_fault_for_the_next_k_requests(sim: Replica, client: httpx.AsyncClient) -> None:
    response = await client.post("/sim/faults", json={"status": 503, "count": 2})
    assert response.status_code == 200 and response.json() == {"fault": {"status": 503}, "count": 2}
    statuses = [(await client.post("/v1/completions", json={"prompt": "x"})).status_code for _ in range(3)]
    assert statuses == [503, 503, 200]
    assert (await client.get("/sim/faults")).json() == {"fault": None}


async def test_server_wide_fault_until_deleted(client: httpx.AsyncClient) -> None:
    assert (await client.post("/sim/faults", json={"error-after": 1})).status_code == 200
    first = await stream_request(client, "/v1/completions", STREAM)
    assert first.error_event is not None
    # A per-request header wins over the server-wide fault.
    clean = await stream_request(client, "/v1/completions", STREAM, headers={"x-sim-fault": "slow-headers=0"})
    assert clean.error_event is None and clean.finish_reason == "length"
    assert (await client.delete("/sim/faults")).json() == {"fault": None}
    assert (await stream_request(client, "/v1/completions", STREAM)).error_event is None


@pytest.mark.parametrize("body", [{"nope": 1}, {"status": 200}, {"status": 503, "count": 0}, [1], {}])
async def test_bad_fault_admin_calls_are_400(client: httpx.AsyncClient, body: object) -> None:
    response = await client.post("/sim/faults", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == 400


async def test_fault_from_config_applies_to_next_k() -> None:
    config = dataclasses.replace(fast_config(), faults=parse_fault_header("status=429"), fault_count=1)
    async with run_sim(config) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        statuses = [(await http.post("/v1/completions", json={"prompt": "x"})).status_code for _ in range(2)]
    assert statuses == [429, 200]


async def test_health_status_can_be_forced(client: httpx.AsyncClient) -> None:
    assert (await client.post("/sim/health", json={"status": 503})).status_code == 200
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/sim/health", json={"status": 200})).status_code == 200
    assert (await client.get("/health")).status_code == 200
    assert (await client.post("/sim/health", json={"status": "bad"})).status_code == 400
