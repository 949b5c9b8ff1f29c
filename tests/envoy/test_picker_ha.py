"""Restarts and losses of the picker, through the real Envoy (issue 13, item 5).

Two pickers behind Envoy's one `picker` cluster, each health-checked on its gRPC `readiness`
service (0.2 s interval); failClose. (a) one picker SIGKILLed under 50 long streams and 20 new
requests per second: no stream is cut, the only failures are new requests whose routing RPC was on
the dead picker before Envoy's health check saw it gone, each the contract's 503 picker-unavailable.
(b) a rolling restart of both (SIGTERM: readiness flips, the picker drains, exits; then it starts
again): no request fails. (c), failOpen with every picker down, is tests/envoy/test_eds.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import async_wait_until, wait_until
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import Result, completion_body, stream_one

pytestmark = pytest.mark.envoy

RATE = 20.0  # new requests per second
LONG_STREAMS = 50
LONG_TOKENS = 200  # 25 ms apart: ~5 s, across the kill
DEADLINE_S = 60.0  # no load loop runs longer


@dataclass
class Sent:
    at: float  # sent (time.time())
    result: Result
    answered: float = 0.0  # its answer's end came back (time.time())


def two_pickers(tmp_path: Path, peers: bool = False) -> Stack:
    options = StackOptions(
        replicas=3,
        pickers=2,
        envoy_picker_tls=False,  # the health port is plaintext: one transport socket for both
        picker_args=("--quiet-interval", "0.3"),
        peers=peers,
    )
    return Stack(tmp_path, options).start()


def picker_health(stack: Stack) -> dict[int, str]:
    """Envoy's health flags of each picker host, by its gRPC port."""
    text = http_client.get(f"http://127.0.0.1:{stack.admin_port}/clusters", timeout=5).text
    flags = {}
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "picker" and parts[2] == "health_flags":
            flags[int(parts[1].rsplit(":", 1)[1])] = parts[3]
    return flags


async def until_healthy(stack: Stack, grpc_port: int, healthy: bool, within: float = 10.0) -> None:
    def check() -> bool:
        return (picker_health(stack).get(grpc_port) == "healthy") == healthy

    await asyncio.to_thread(wait_until, check, within, 0.02, f"picker {grpc_port} healthy={healthy} in Envoy")


async def open_loop(
    client: httpx.AsyncClient, url: str, stop: asyncio.Event, max_tokens: int, sent: list[Sent]
) -> None:
    """RATE new streaming requests a second until `stop` (bounded by DEADLINE_S and count)."""
    tasks: list[asyncio.Task[None]] = []

    async def one(at: float) -> None:
        result = await stream_one(client, url, completion_body(max_tokens))
        sent.append(Sent(at, result, time.time()))

    started = time.monotonic()
    for index in range(int(RATE * DEADLINE_S)):
        due = started + index / RATE
        if stop.is_set() or due - started > DEADLINE_S:
            break
        delay = due - time.monotonic()
        if delay > 0:
            try:  # paces the open loop; `stop` ends it early
                await asyncio.wait_for(stop.wait(), delay)
                break
            except TimeoutError:
                pass
        tasks.append(asyncio.create_task(one(time.time())))
    await asyncio.gather(*tasks)


def picker_in_flight(metrics_port: int) -> float:
    text = http_client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return parse_metrics(text).get(("picker_in_flight", ()), 0.0)


def failed(sent: list[Sent]) -> list[Sent]:
    return [s for s in sent if s.result.status != 200 or not s.result.done]


def client() -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    return http_client.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, connect=5.0))


def survivor_books(stack: Stack) -> tuple[float, float]:
    """(what the surviving picker counts on the replicas, its own and its peers', what they run)."""
    values = parse_metrics(http_client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).text)
    counted = sum(
        v
        for (name, _), v in values.items()
        if name in ("picker_endpoint_in_flight", "picker_endpoint_peer_in_flight")
    )
    return counted, stack.sim_value("vllm:num_requests_running")


@pytest.mark.parametrize("peers", [False, True], ids=["separate-books", "one-set-of-books"])
async def test_one_of_two_pickers_killed_cuts_no_stream(tmp_path: Path, peers: bool) -> None:
    stack = two_pickers(tmp_path, peers)
    try:
        victim_port = stack.picker_ports[1][0]
        await until_healthy(stack, victim_port, True)
        await until_healthy(stack, stack.grpc_port, True)
        async with client() as http:
            flowing = [asyncio.Event() for _ in range(LONG_STREAMS)]
            streams = [
                asyncio.create_task(stream_one(http, stack.url, completion_body(LONG_TOKENS), first_event=e))
                for e in flowing
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 20)
            stop = asyncio.Event()
            sent: list[Sent] = []
            load = asyncio.create_task(open_loop(http, stack.url, stop, 4, sent))
            await async_wait_until(lambda: len(sent) >= 20, 20, what="new requests flowing")
            victim_in_flight = picker_in_flight(stack.picker_ports[1][2])
            killed_at = time.time()
            victim = stack.pickers[1]
            assert victim is not None
            victim.kill()
            await until_healthy(stack, victim_port, False)
            unhealthy_s = time.time() - killed_at
            await asyncio.sleep(max(0.0, killed_at + 1.0 - time.time()))  # a measurement point: 1 s on
            short_open = sum(1 for s in sent if s.at >= time.time() - 0.5)  # the 4-token ones in flight
            counted, running = await asyncio.to_thread(survivor_books, stack)
            await async_wait_until(lambda: len(sent) >= 100, 20, what="traffic after the kill")
            stop.set()
            await asyncio.wait_for(load, DEADLINE_S)
            long_results = await asyncio.wait_for(asyncio.gather(*streams), DEADLINE_S)
        if peers:  # every stream over: the dead picker's requests are off the survivor's books
            await asyncio.to_thread(
                wait_until, lambda: survivor_books(stack)[0] == 0, 10, 0.05, "the survivor's books at 0"
            )
            orphans_left = stack.picker_value("picker_peer_orphans")
        cut = [r for r in long_results if r.status != 200 or not r.done]
        bad = failed(sent)
        after = [s for s in sent if s.at >= killed_at]
        figures = {
            "victim_in_flight_at_kill": victim_in_flight,
            "long_streams": len(long_results),
            "streams_cut": len(cut),
            "new_requests": len(sent),
            "after_kill": len(after),
            "failed": len(bad),
            "failed_reasons": sorted({(s.result.status, s.result.reason_header) for s in bad}),
            "last_failure_after_kill_s": round(max((s.at - killed_at for s in bad), default=0.0), 3),
            "envoy_marked_unhealthy_s": round(unhealthy_s, 3),
            "survivor_counts_1s_after": counted,
            "replicas_run_1s_after": running,
        }
        print("one of two pickers SIGKILLed:", json.dumps(figures))
        assert victim_in_flight >= 5, figures  # the dead picker had routed some of the streams
        assert not cut, figures
        # only requests that went to the dead picker before Envoy's health check marked it, each
        # the contract's retryable 503 (never a bare 503, never a stream)
        for s in bad:
            assert s.result.status == 503 and s.result.reason_header == "picker-unavailable", figures
            assert s.result.retry_after, figures
            assert s.at - killed_at < unhealthy_s + 1.0, figures
        assert len(bad) <= 0.5 * RATE * (unhealthy_s + 1.0), figures
        assert unhealthy_s < 5.0, figures
        if peers:  # the survivor still counts the dead picker's streams (they run on), exactly
            assert abs(counted - running) <= short_open + 1, figures
            assert orphans_left == 0, figures
        else:  # without shared books it knows only its own: the dead picker's streams are invisible
            assert running - counted >= 5, figures
    finally:
        stack.stop()


async def test_rolling_restart_of_both_pickers_fails_nothing(tmp_path: Path) -> None:
    stack = two_pickers(tmp_path)
    try:
        for grpc_port, _, _ in stack.picker_ports:
            await until_healthy(stack, grpc_port, True)
        async with client() as http:
            stop = asyncio.Event()
            sent: list[Sent] = []
            load = asyncio.create_task(open_loop(http, stack.url, stop, 40, sent))  # ~1 s streams
            await async_wait_until(lambda: len(sent) >= 20, 20, what="traffic flowing")
            restarts = []
            for index in range(2):
                proc = stack.pickers[index]
                assert proc is not None
                began = time.time()
                proc.signal(signal.SIGTERM)  # readiness flips; it drains what it routes, then exits
                code = await asyncio.to_thread(proc.wait_exit, 30)
                assert code == 0, proc.log_text()[-2000:]
                exited = time.time()
                await asyncio.to_thread(stack.start_picker_at, index)
                await until_healthy(stack, stack.picker_ports[index][0], True)
                restarts.append(
                    {"drain_s": round(exited - began, 2), "back_s": round(time.time() - began, 2)}
                )
                count = len(sent)
                await async_wait_until(lambda c=count: len(sent) >= c + 20, 20, what="traffic after restart")
            stop.set()
            await asyncio.wait_for(load, DEADLINE_S)
        bad = failed(sent)
        figures = {
            "requests": len(sent),
            "failed": len(bad),
            "failed_reasons": sorted(
                {(s.result.status, s.result.reason_header, s.result.error) for s in bad}
            ),
            "restarts": restarts,
        }
        print("rolling restart of two pickers:", json.dumps(figures))
        assert not bad, figures
    finally:
        stack.stop()
