"""The picker's own shutdown as its load balancers see it, through the real Envoy: phase 1 turns the
gRPC readiness services NOT_SERVING while liveness stays SERVING and requests are still admitted;
a second signal skips to the end."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one

pytestmark = pytest.mark.envoy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
READY_NAMES = ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def health(stack: Stack, service: str) -> int:
    """One gRPC health Check on the picker's (plaintext) health port."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return int(reply.status)


def summary_line(stack: Stack) -> str:
    assert stack.picker is not None
    return next(line for line in stack.picker.log_text().splitlines() if "picker shutdown done" in line)


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    args: tuple[str, ...] = request.param
    stack = Stack(tmp_path, StackOptions(replicas=2, picker_args=args)).start()
    try:
        yield stack
    finally:
        stack.stop()


# Phase 1 lasts two quiet intervals after the last arrival: 8 s with no traffic, long enough to look.
@pytest.mark.parametrize(
    "stack", [("--quiet-interval", "4", "--propagation", "30", "--drain-timeout", "40")], indirect=True
)
def test_phase_one_flips_readiness_keeps_liveness_and_admits(stack: Stack) -> None:
    assert stack.picker is not None
    assert {name: health(stack, name) for name in (*READY_NAMES, "liveness")} == dict.fromkeys(
        (*READY_NAMES, "liveness"), SERVING
    )
    stack.picker.signal(signal.SIGTERM)
    wait_until(lambda: health(stack, "readiness") == NOT_SERVING, 10, what="readiness NOT_SERVING")

    # Still in phase 1: the readiness services say go away, liveness says do not restart me, and a
    # request that arrives (the load balancer has not noticed yet) is admitted and served.
    assert {name: health(stack, name) for name in READY_NAMES} == dict.fromkeys(READY_NAMES, NOT_SERVING)
    assert health(stack, "liveness") == SERVING
    reply = http_client.post(f"{stack.url}/v1/completions", json=completion_body(5, stream=False), timeout=20)
    assert reply.status_code == 200, (reply.status_code, reply.headers, reply.text[:300])
    assert "x-picker-dropped-reason" not in reply.headers
    assert health(stack, "liveness") == SERVING  # the picker is still alive and still in its drain
    assert stack.picker.alive()

    assert stack.picker.wait_exit(40) == 0
    assert "arrivals_during=1 " in summary_line(stack)
    assert "forced=False" in summary_line(stack)


# Without a second signal this shutdown would take 40 s of quiet, then wait for a 50 s stream.
@pytest.mark.parametrize(
    "stack", [("--quiet-interval", "20", "--propagation", "60", "--drain-timeout", "100")], indirect=True
)
async def test_second_signal_skips_to_the_end(stack: Stack) -> None:
    assert stack.picker is not None
    async with http_client.AsyncClient(timeout=120) as client:
        held = asyncio.create_task(stream_one(client, stack.url, completion_body(2000)))  # 50 s
        try:
            await asyncio.to_thread(
                wait_until, lambda: stack.picker_value("picker_in_flight") == 1, 10, what="a stream in flight"
            )
            stack.picker.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_until, lambda: health(stack, "readiness") == NOT_SERVING, 10, what="shutdown started"
            )
            assert stack.picker.alive()
            stack.picker.signal(signal.SIGTERM)
            code = await asyncio.to_thread(stack.picker.wait_exit, 15)
        finally:
            held.cancel()
            await asyncio.gather(held, return_exceptions=True)
    assert code == 0, stack.picker.log_text()[-2000:]
    line = summary_line(stack)
    assert "forced=True" in line and "live_at_start=1" in line, line
    assert "second signal" in stack.picker.log_text()
