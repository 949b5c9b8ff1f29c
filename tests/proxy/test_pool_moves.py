"""Moves that reach every stream (issue 52, item 4): two `picker proxy` processes share one set of books
over the peer channel and one endpoints file; streams run through both to the same replica. A drain
with `?move_streams=true` POSTed to one of them moves the streams of both: the replica's running
count reaches zero at once (its streams had seconds left), every stream completes with the text of an
uncut run, and the answer counts every moved stream, by picker. Before, only the streams of the
proxy that received the POST moved (with N proxies behind a Service, about 1/N of them)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from loadtest import http_client
from loadtest.procs import async_wait_until
from loadtest.proxy_stack import PeeredProxies
from loadtest.stack import StackOptions, parse_metrics
from tests.proxy.test_resume import COMPLETION, Stream, read_stream

STREAMS_EACH = 10  # through each proxy
TOKENS, SLOW = 150, {"x-sim-itl-ms": "40"}  # 6 s a stream: a drain that waited would take seconds


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeeredProxies]:
    options = StackOptions(
        replicas=3,
        sim_args=("--ttft-ms", "5", "--itl-ms", "8"),
        picker_env={"PICKER_STREAMS__RESUME": "greedy"},
    )
    started = PeeredProxies(tmp_path_factory.mktemp("pool-moves"), options)
    try:
        started.start()
        yield started
    finally:
        started.stop()


def running_on(replica: str) -> float:
    """The replica's own count of the requests it is running (vLLM's gauge)."""
    text = http_client.get(f"http://{replica}/metrics", timeout=5).text
    return sum(v for (name, _), v in parse_metrics(text).items() if name == "vllm:num_requests_running")


async def test_a_drain_through_one_proxy_moves_the_streams_of_both(stack: PeeredProxies) -> None:
    body = {**COMPLETION, "max_tokens": TOKENS}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        uncut = await read_stream(session, stack.proxy_url(0), "/v1/completions", body)
        assert uncut.status == 200 and uncut.done == 1 and uncut.tokens == TOKENS
        seen = [Stream() for _ in range(2 * STREAMS_EACH)]
        through = [i // STREAMS_EACH for i in range(len(seen))]  # which proxy each stream goes through
        events = [asyncio.Event() for _ in seen]
        tasks = [
            asyncio.create_task(
                read_stream(session, stack.proxy_url(p), "/v1/completions", body, SLOW, 10, e, out)
            )
            for p, e, out in zip(through, events, seen, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 20)
        on = {
            r: [sum(s.served == r for s, p in zip(seen, through, strict=True) if p == i) for i in (0, 1)]
            for r in stack.replicas
        }
        victim = max((r for r in stack.replicas if min(on[r]) > 0), key=lambda r: sum(on[r]))
        assert running_on(victim) == sum(on[victim])  # the streams both proxies sent it, running

        url = f"{stack.admin_url(0)}/admin/endpoints/{victim}/drain?move_streams=true"
        loop = asyncio.get_running_loop()
        posted = loop.time()
        async with session.post(url) as response:
            status, answer = response.status, await response.json()
        assert status == 200, answer
        # the streams had 5 s left: without the peer's moves its own would hold the replica that long
        await async_wait_until(
            lambda: running_on(victim) == 0, 3, interval=0.02, what="the replica to run nothing"
        )
        to_zero = loop.time() - posted
        results: list[Stream] = await asyncio.wait_for(asyncio.gather(*tasks), 60)

    print(f"on the drained replica, through proxy 0 / 1: {on[victim]}; running 0 after {to_zero:.3f} s")
    assert answer["moved_streams"] == sum(on[victim])
    assert answer["moved_streams_by_picker"] == {
        stack.peer_name(0): on[victim][0],
        stack.peer_name(1): on[victim][1],
    }
    assert answer["moved_streams_unreached"] == {}
    assert [r for r in results if r.status != 200 or r.broken or r.done != 1 or r.tokens != TOKENS] == []
    assert {r.text for r in results} == {uncut.text}  # each the uncut run's text, moved or not
    for index in (0, 1):  # each proxy continued its own streams elsewhere
        moved = stack.metric(index, "picker_stream_resumes_total", reason="drain-moved")
        assert moved == on[victim][index], (index, moved)
    assert stack.metric(0, "picker_peer_move_answers_rejected_total", reason="bad-count") == 0
    view: dict[str, Any] = http_client.get(f"{stack.admin_url(1)}/admin/endpoints/{victim}", timeout=5).json()
    assert view["endpoint"]["state"] == "draining" and view["endpoint"]["in_flight"] == 0
