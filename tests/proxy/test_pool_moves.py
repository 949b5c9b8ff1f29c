"""Moves that reach every stream (issue 52, item 4): two `picker proxy` processes share one set of books
over the peer channel and one endpoints file; streams run through both to the same replica. A drain
with `?move_streams=true` POSTed to one of them moves the streams of both: the replica's running
count reaches zero at once (its streams had seconds left), every stream completes with the text of an
uncut run, and the answer counts every moved stream, by picker. Before, only the streams of the
proxy that received the POST moved (with N proxies behind a Service, about 1/N of them)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest import http_client
from loadtest.procs import Proc, async_wait_until, free_port, port_open, wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions, parse_metrics
from tests.proxy.test_resume import COMPLETION, Stream, read_stream

STREAMS_EACH = 10  # through each proxy
TOKENS, SLOW = 150, {"x-sim-itl-ms": "40"}  # 6 s a stream: a drain that waited would take seconds


class TwoProxies(ProxyStack):
    """Replicas + two `picker proxy` processes, peers of each other (one set of books, the channel's
    credential), both reading one endpoints file (so a drain through either reaches both pools)."""

    def __init__(self, workdir: Path) -> None:
        options = StackOptions(
            replicas=3,
            sim_args=("--ttft-ms", "5", "--itl-ms", "8"),
            static_endpoints=False,
            pickers=2,
            peers=True,
            picker_env={"PICKER_STREAMS__RESUME": "greedy"},
        )
        super().__init__(workdir, options)
        self.proxy_ports = [self.listen_port, free_port()]
        endpoints = workdir / "endpoints.yaml"
        endpoints.write_text(json.dumps([{"address": a} for a in self.replicas]))  # JSON is YAML
        config = workdir / "picker.yaml"
        config.write_text(
            json.dumps({"pool": {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}})
        )
        self.options.picker_args = ("--config", str(config))

    def proxy_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.proxy_ports[index]}"

    def admin_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.picker_ports[index][2]}"

    def peer_name(self, index: int) -> str:
        return f"127.0.0.1:{self.peer_ports[index]}"

    def picker_argv(self, index: int = 0) -> list[str]:
        return [
            sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1",
            "--port", str(self.proxy_ports[index]), "--metrics-port", str(self.picker_ports[index][2]),
            "--quiet-interval", "0.2", *self.peer_args(index), *self.options.picker_args,
        ]  # fmt: skip

    def start_picker(self) -> None:
        for index, port in enumerate(self.proxy_ports):
            proc = Proc(
                f"picker-proxy-{index}",
                self.picker_argv(index),
                self.workdir / f"picker-proxy-{index}.log",
                env=self.options.picker_env,
            )
            self.pickers[index] = proc  # stopped by Stack.stop, started or not
            if index == 0:
                self.picker = proc
            proc.wait_ready(
                lambda p=proc, port=port: "picker proxy ready" in p.log_text() and port_open(port)
            )
        for index in range(2):  # each one's link to the other is open: they share the books
            wait_until(lambda i=index: self.metric(i, "picker_peers_connected") == 1, 15, what="peer links")

    def metric(self, index: int, name: str, **labels: str) -> float:
        text = http_client.get(f"{self.admin_url(index)}/metrics", timeout=5).text
        return parse_metrics(text).get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoProxies]:
    started = TwoProxies(tmp_path_factory.mktemp("pool-moves"))
    try:
        started.start()
        yield started
    finally:
        started.stop()


def running_on(replica: str) -> float:
    """The replica's own count of the requests it is running (vLLM's gauge)."""
    text = http_client.get(f"http://{replica}/metrics", timeout=5).text
    return sum(v for (name, _), v in parse_metrics(text).items() if name == "vllm:num_requests_running")


async def test_a_drain_through_one_proxy_moves_the_streams_of_both(stack: TwoProxies) -> None:
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
