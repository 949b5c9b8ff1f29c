"""The proxy's own failure handling: draining engines, dead endpoints, slow clients, its drain deadline."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

from loadtest import http_client
from loadtest.procs import free_port, wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.sse_client import stream_request
from loadtest.stack import StackOptions
from loadtest.traffic import REPLICA_HEADER, completion_body, stream_one
from tests.proxy.conftest import FAST


async def test_draining_engines_500_is_retried_on_the_next_pick(tmp_path: Path) -> None:
    stack = ProxyStack(
        tmp_path, StackOptions(replicas=2, sim_args=FAST, picker_args=("--no-scrape",))
    ).start()
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            # one long stream on each replica: equal in-flight counts, so either may be picked first
            flowing = [asyncio.Event(), asyncio.Event()]
            holders = [
                asyncio.create_task(stream_one(client, stack.url, completion_body(3000), first_event=event))
                for event in flowing
            ]
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), 10)
            busy = next(r for r in stack.replicas if any(e["end"] is None for e in stack.sim_requests(r)))
            other = next(r for r in stack.replicas if r != busy)
            # vLLM's drain: new completions get 500 "cannot schedule new futures after shutdown"
            (await client.post(f"http://{busy}/sim/shutdown", json={"timeout": 60})).raise_for_status()
            picked_before = stack.picker_value("picker_picks_total", endpoint=busy)
            for _ in range(40):
                if stack.picker_value("picker_picks_total", endpoint=busy) >= picked_before + 2:
                    break
                result = await stream_one(client, stack.url, completion_body(2))
                assert result.ok and result.replica == other
            assert stack.picker_value("picker_picks_total", endpoint=busy) >= picked_before + 2
            refused = [e for e in stack.sim_requests(busy) if e["outcome"] == "shutdown-500"]
            assert len(refused) >= 2
            for holder in holders:
                holder.cancel()
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_no_endpoint_answering_gets_the_contracts_503(tmp_path: Path) -> None:
    dead = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    stack = ProxyStack(
        tmp_path, StackOptions(replicas=0, picker_endpoints=dead, picker_args=("--no-scrape",))
    ).start()
    try:
        async with http_client.AsyncClient(timeout=10) as client:
            response = await client.post(stack.url + "/v1/completions", json=completion_body(2))
        assert response.status_code == 503
        assert response.headers["x-picker-dropped-reason"] == "rejected-no-endpoints"
        assert int(response.headers["retry-after"]) >= 1
        assert stack.picker_value("picker_request_ends_total", reason="upstream-error-status") == 1
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_slow_client_slows_its_upstream_instead_of_growing_memory(tmp_path: Path) -> None:
    # A stream that the engine could send in well under a second, to a client that reads nothing.
    sim = ("--ttft-ms", "1", "--itl-ms", "0.01", "--tokens-per-chunk", "64", "--max-model-len", "100000000")
    sim += ("--kv-capacity-tokens", "100000000")
    stack = ProxyStack(tmp_path, StackOptions(replicas=1, sim_args=sim, picker_args=("--no-scrape",))).start()
    # ~56 MB of SSE; the kernel's loopback buffers hold ~7 MB of it, the proxy must hold next to none
    total = 8_000_000
    try:
        (replica,) = stack.replicas
        body = json.dumps(completion_body(total)).encode()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.connect(("127.0.0.1", stack.listen_port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        try:
            sent: list[int] = []

            def settled() -> bool:
                entries = stack.sim_requests(replica)
                sent.append(entries[-1]["tokens_sent"] if entries else 0)
                return len(sent) >= 5 and sent[-1] > 0 and sent[-1] == sent[-5]

            wait_until(settled, 40, interval=0.2, what="the upstream to stop sending")
            entry = stack.sim_requests(replica)[-1]
            assert entry["end"] is None  # still running: held back, not finished into a buffer
            assert entry["tokens_sent"] < total // 4, entry
        finally:
            sock.close()
        wait_until(lambda: stack.sim_requests(replica)[-1]["outcome"] == "aborted", 5)
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_drain_deadline_ends_streams_with_an_error_event_and_done(tmp_path: Path) -> None:
    args = ("--no-scrape", "--drain-timeout", "1.5", "--propagation", "0.2")
    stack = ProxyStack(tmp_path, StackOptions(replicas=1, sim_args=FAST, picker_args=args)).start()
    try:
        assert stack.picker is not None
        async with http_client.AsyncClient(timeout=30) as client:
            flowing = asyncio.Event()
            stream = asyncio.create_task(
                stream_request(
                    client, stack.url + "/v1/completions", completion_body(2000), first_event=flowing
                )
            )
            plain = asyncio.create_task(
                client.post(stack.url + "/v1/completions", json=completion_body(2000, stream=False))
            )
            await asyncio.wait_for(flowing.wait(), 10)
            await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == 2, 10)
            ready = f"http://127.0.0.1:{stack.metrics_port}/ready"
            assert (await client.get(ready)).status_code == 200
            stack.picker.signal(signal.SIGTERM)
            await asyncio.to_thread(
                wait_until, lambda: http_client.get(ready, timeout=2).status_code == 503, 5, what="not ready"
            )
            streamed, answered = await asyncio.wait_for(asyncio.gather(stream, plain), 20)
        assert streamed.status == 200 and streamed.done  # [DONE] came, after ...
        error = streamed.events[-2].json
        assert error is not None and error["error"]["reason"] == "rejected-shutting-down", streamed.events[
            -2:
        ]
        assert len(streamed.events) < 1000  # ... a cut, long before the stream's own end
        assert answered.status_code == 503
        assert answered.headers["x-picker-dropped-reason"] == "rejected-shutting-down"
        assert REPLICA_HEADER not in answered.headers
        assert await asyncio.to_thread(stack.picker.wait_exit, 15) == 0
        summary = next(line for line in stack.picker.log_text().splitlines() if "shutdown done" in line)
        assert "cut_at_deadline=2" in summary
    finally:
        stack.stop()


async def test_a_generic_500_before_the_first_byte_is_retried_as_the_envoy_route_does(tmp_path: Path) -> None:
    """The shipped Envoy route retries 500 and 503 on the next endpoint of the picker's list (nothing
    was streamed yet); the proxy does the same: with every replica's next request failing with a
    plain 500 on one of two replicas, 20 of 20 requests succeed."""
    stack = ProxyStack(
        tmp_path, StackOptions(replicas=2, sim_args=FAST, picker_args=("--no-scrape",))
    ).start()
    try:
        async with http_client.AsyncClient(timeout=30) as client:
            broken = stack.replicas[0]
            answer = await client.post(f"http://{broken}/sim/faults", json={"status": 500})
            answer.raise_for_status()
            results = [await stream_one(client, stack.url, completion_body(2)) for _ in range(20)]
        assert [r for r in results if not r.ok] == []
        assert all(r.replica != broken for r in results)
        stack.wait_no_leaks()
    finally:
        stack.stop()
