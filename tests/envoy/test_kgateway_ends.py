"""The kgateway shape (response headers SKIP, no observer): Envoy keeps the routing stream open through
the response and closes it at the response's end, so that close is the request's end, on whichever
picker routed it (issue 23). Without an access log to the picker its reason is unknowable
(`unobserved`); with one, the log entry says it. Checked against the simulator's log of when it sent
the last byte, through a drain record's time to zero."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.sse_client import stream_request
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one

pytestmark = pytest.mark.envoy


async def test_the_request_ends_when_its_response_ends_not_a_grace_later(tmp_path: Path) -> None:
    options = StackOptions(
        replicas=1, shape="kgateway", envoy_picker_tls=False, sim_args=("--ttft-ms", "5", "--itl-ms", "20")
    )
    stack = Stack(tmp_path, options).start()
    try:
        (replica,) = stack.replicas
        admin = f"http://127.0.0.1:{stack.metrics_port}"
        async with http_client.AsyncClient(timeout=30) as http:
            flowing = asyncio.Event()
            stream = asyncio.create_task(
                stream_one(
                    http, stack.url, completion_body(60), {"x-request-id": "kg-1"}, first_event=flowing
                )
            )
            await asyncio.wait_for(flowing.wait(), 10)
            (await http.post(f"{admin}/admin/endpoints/{replica}/drain?force=true")).raise_for_status()
            result = await asyncio.wait_for(stream, 30)
            assert result.ok
            deadline = time.monotonic() + 10
            while True:  # the record's time to zero, once the request has ended (bounded poll)
                drains = (await http.get(f"{admin}/admin/drains")).json()["drains"]
                if (drains and drains[0]["time_to_zero_s"] is not None) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        (drain,) = drains
        zero_wall = drain["started_wall"] + drain["time_to_zero_s"]
        (entry,) = [e for e in stack.sim_requests(replica) if e["request_id"] == "kg-1"]
        lag = zero_wall - entry["end"]
        # the replica's last byte (measured within 0.1 s), not the 2 s timer after it; the bound leaves
        # a busy machine a second
        assert -0.05 < lag < 1.0, (lag, drain, entry)
        assert stack.picker_value("picker_request_ends_total", reason="client-disconnect") == 0
        assert (
            stack.picker_value("picker_request_ends_total", reason="unobserved") == 1
        )  # honest: how, unseen
    finally:
        stack.stop()


# (case, request headers, how the client reads it, the picker's end reason, the drain record's end)
ENDINGS = (
    ("completed", {}, None, "completed", "completed"),
    ("client-left", {}, 3, "client-disconnect", "client-disconnect"),
    ("cut", {"x-sim-fault": "reset-after=3"}, None, "upstream-truncated", "cut"),
)


async def test_with_a_grpc_access_log_each_end_has_its_reason_and_its_real_time(tmp_path: Path) -> None:
    """kgateway's HTTPListenerPolicy can send Envoy's gRPC access log to the picker: the routing
    stream's close dates the end, the log entry (a flush later) says how it ended."""
    options = StackOptions(
        replicas=1,
        shape="kgateway",
        envoy_picker_tls=False,
        picker_access_log=True,
        access_log_flush_interval="0.5s",  # entries come up to half a second after the end
        picker_args=("--response-end", "access-log", "--no-scrape"),
        sim_args=("--ttft-ms", "5", "--itl-ms", "20"),
    )
    stack = Stack(tmp_path, options).start()
    try:
        (replica,) = stack.replicas
        admin = f"http://127.0.0.1:{stack.metrics_port}"
        async with http_client.AsyncClient(timeout=30) as http:
            for case, extra, leave_after, reason, drain_end in ENDINGS:
                request_id = f"kg-{case}"
                flowing = asyncio.Event()
                stream = asyncio.create_task(
                    stream_request(
                        http,
                        stack.url + "/v1/completions",
                        completion_body(60),
                        headers={"x-request-id": request_id, **extra},
                        first_event=flowing,
                        disconnect_after_events=leave_after,
                    )
                )
                await asyncio.wait_for(flowing.wait(), 10)
                (await http.post(f"{admin}/admin/endpoints/{replica}/drain?force=true")).raise_for_status()
                await asyncio.wait_for(stream, 30)
                deadline = time.monotonic() + 10
                while True:  # the record's time to zero, once the request has ended (bounded poll)
                    drain = (await http.get(f"{admin}/admin/drains")).json()["drains"][0]
                    if drain["time_to_zero_s"] is not None or time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)
                (await http.post(f"{admin}/admin/endpoints/{replica}/undrain")).raise_for_status()
                (entry,) = [e for e in stack.sim_requests(replica) if e["request_id"] == request_id]
                lag = drain["started_wall"] + drain["time_to_zero_s"] - entry["end"]
                assert -0.05 < lag < 0.1, (case, lag, drain, entry)  # the close, not the log's flush
                assert {k: v for k, v in drain["ended"].items() if v} == {drain_end: 1}, (case, drain)
                assert stack.picker_value("picker_request_ends_total", reason=reason) == 1, case
        assert stack.picker_value("picker_request_ends_total", reason="unobserved") == 0
    finally:
        stack.stop()
