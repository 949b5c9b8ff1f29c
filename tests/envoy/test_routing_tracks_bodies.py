"""The routing filter with `response_body_mode: STREAMED` and no observer filter, through the real Envoy.

The README says the routing stream tracks response bodies itself when an operator configures it this
way (the benchmarked "streamed" design). Here it is held to the same guarantees as the observer: tokens
counted from the body, completion vs client disconnect vs truncation told apart, an SSE error event in
a 200 stream caught (only the body shows it), in-flight back to exactly 0.
"""

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
def streamed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(replicas=2, sim_args=FAST, observer=False, routing_response_body="STREAMED")
    stack = Stack(tmp_path_factory.mktemp("streamed"), options).start()
    try:
        yield stack
    finally:
        stack.stop()


def ends(stack: Stack, reason: str) -> float:
    return stack.picker_value("picker_request_ends_total", reason=reason)


def tokens(stack: Stack) -> float:
    return sum(v for (name, _), v in stack.picker_metrics().items() if name == "picker_output_tokens_total")


async def test_a_stream_is_counted_from_its_body_and_completes(streamed: Stack) -> None:
    completed, counted = ends(streamed, "completed"), tokens(streamed)
    async with http_client.AsyncClient(timeout=30) as client:
        result = await stream_one(client, streamed.url, completion_body(40))
    assert result.ok, result
    await asyncio.to_thread(wait_until, lambda: ends(streamed, "completed") == completed + 1, 10)
    assert tokens(streamed) - counted == 40  # the routing stream saw every token chunk
    streamed.wait_no_leaks()


async def test_disconnect_truncation_and_error_event_are_told_apart(streamed: Stack) -> None:
    reasons = ("client-disconnect", "upstream-truncated", "upstream-error-event")
    before = {r: ends(streamed, r) for r in reasons}
    async with http_client.AsyncClient(timeout=10) as client:
        left = await stream_request(  # the client leaves mid-stream
            client, streamed.url + "/v1/completions", completion_body(2000), disconnect_after_events=3
        )
        cut = await stream_one(client, streamed.url, completion_body(50), {"x-sim-fault": "reset-after=3"})
        failed = await stream_one(client, streamed.url, completion_body(50), {"x-sim-fault": "error-after=3"})
    assert left.end == "disconnected" and not cut.done
    assert failed.status == 200 and failed.done  # a 200 stream that ends with [DONE]: only the body tells
    for reason in reasons:
        await asyncio.to_thread(wait_until, lambda r=reason: ends(streamed, r) == before[r] + 1, 10)
    streamed.wait_no_leaks()
    assert ends(streamed, "unobserved") == 0
