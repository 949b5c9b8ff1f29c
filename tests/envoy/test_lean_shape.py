"""The lean shape through the real Envoy: the shipped config without the observer filter, so no
response chunk reaches the picker, and Envoy's gRPC access log ends every request (issue 15). The
guarantees that must survive: in-flight exact, completion vs client disconnect vs truncation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.sse_client import stream_request
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one

pytestmark = pytest.mark.envoy

FAST = ("--ttft-ms", "5", "--itl-ms", "10")


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # without scraping, nothing but the access log can end a stream that outlives the grace
    options = StackOptions(replicas=2, sim_args=FAST, picker_args=("--no-scrape",), observer=False)
    stack = Stack(tmp_path_factory.mktemp("lean"), options).start()
    try:
        yield stack
    finally:
        stack.stop()


def ends(stack: Stack, reason: str) -> float:
    return stack.picker_value("picker_request_ends_total", reason=reason)


async def test_streams_longer_than_the_grace_end_completed_from_the_access_log(lean: Stack) -> None:
    before = ends(lean, "completed")
    async with http_client.AsyncClient(timeout=30) as client:
        # 300 tokens x 10 ms: the stream outlives the observer grace (2 s), so it is the log's to end
        results = await asyncio.gather(
            stream_one(client, lean.url, completion_body(300)),
            *(stream_one(client, lean.url, completion_body(4)) for _ in range(20)),
        )
    assert all(r.status == 200 and r.done for r in results)
    await asyncio.to_thread(wait_until, lambda: ends(lean, "completed") == before + 21, 10)
    lean.wait_no_leaks()
    assert ends(lean, "unobserved") == 0


async def test_client_disconnect_and_truncation_are_told_apart(lean: Stack) -> None:
    disconnects, truncations = ends(lean, "client-disconnect"), ends(lean, "upstream-truncated")
    async with http_client.AsyncClient(timeout=10) as client:
        left = await stream_request(  # the client leaves mid-stream
            client, lean.url + "/v1/completions", completion_body(2000), disconnect_after_events=3
        )
        cut = await stream_one(client, lean.url, completion_body(50), {"x-sim-fault": "reset-after=3"})
    assert left.end == "disconnected" and not cut.done
    await asyncio.to_thread(wait_until, lambda: ends(lean, "client-disconnect") == disconnects + 1, 10)
    await asyncio.to_thread(wait_until, lambda: ends(lean, "upstream-truncated") == truncations + 1, 10)
    lean.wait_no_leaks()
    assert ends(lean, "unobserved") == 0
