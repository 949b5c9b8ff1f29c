"""A replica that fails fast must not attract traffic (issue 13, item 1), through the real Envoy.

The late-learning sequence measured on real vLLM: a replica gets SIGTERM (drain mode,
--shutdown-timeout) and answers every new request at once with `500 cannot schedule new futures after
shutdown`; the picker learns of the drain only 2 s later, when the endpoints file says so. Each 500
ends at once, so the failing replica holds the fewest requests and would keep the best score.

Shipped config: Envoy retries that 500 (it comes before any response byte) on the next endpoint of
the picker's list, the picker counts each move past the primary against it and stops picking it as
primary after 3 in a row: no 500 reaches a client. The same sequence with 500 left out of the retried
codes shows the failure is real (clients see the 500s).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.sse_client import stream_request
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Result, completion_body, stream_one
from picker.cli.envoyconf import SHAPES, SHIPPED

pytestmark = pytest.mark.envoy

LEARN_LATE_S = 2.0  # SIGTERM -> the endpoints file says draining (Kubernetes propagation lag)
CONCURRENCY = 6
MAX_REQUESTS = 1500  # bounds the loop in count; `Traffic.stop` and DEADLINE_S bound it in time
DEADLINE_S = 40.0


class Traffic:
    """Closed-loop streaming completions until stopped; every result kept with its start time."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[float, Result]] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Traffic:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._task is not None
        await asyncio.wait_for(self._task, DEADLINE_S)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY + 4)
        deadline = time.monotonic() + DEADLINE_S
        async with http_client.AsyncClient(limits=limits, timeout=httpx.Timeout(20.0, connect=5.0)) as client:

            async def worker() -> None:
                while not self._stop.is_set() and len(self.results) < MAX_REQUESTS:
                    if time.monotonic() > deadline:
                        return
                    started = time.time()
                    result = await stream_one(client, self.url, completion_body(12))
                    self.results.append((started, result))

            await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))

    async def run_for(self, count: int) -> None:
        """Wait until `count` more requests have finished (a bounded wait, not a sleep)."""
        target = len(self.results) + count
        deadline = time.monotonic() + DEADLINE_S
        while len(self.results) < target:
            assert time.monotonic() < deadline, f"traffic stalled at {len(self.results)} of {target}"
            assert self._task is not None and not self._task.done(), "traffic ended early"
            await asyncio.sleep(0.05)  # polling the condition above, not synchronising on time


def write_endpoints(path: Path, replicas: list[str], draining: str | None = None) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps([{"address": a, "draining": a == draining} for a in replicas]))
    temp.replace(path)


def drain_record(stack: Stack, address: str) -> dict[str, Any] | None:
    view = http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()
    endpoint = next((e for e in view["endpoints"] if e["address"] == address), None)
    return None if endpoint is None else endpoint["drain"]  # type: ignore[no-any-return]


async def late_learning(
    tmp_path: Path, shape: str, scheduling: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the sequence once; what clients and the picker saw."""
    endpoints = tmp_path / "endpoints.yaml"
    config = tmp_path / "picker.yaml"
    pool = {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}
    config.write_text(json.dumps({"pool": pool, "scheduling": scheduling or {}}))
    options = StackOptions(
        replicas=3,
        # drain mode as vLLM's --shutdown-timeout; the listener stays up long after, so the
        # replica's own request log can still be read
        sim_args=(
            "--ttft-ms",
            "20",
            "--itl-ms",
            "25",
            "--shutdown-timeout",
            "20",
            "--post-drain-close-s",
            "60",
        ),
        picker_args=("--config", str(config)),
        static_endpoints=False,
        shape=shape,
    )
    stack = Stack(tmp_path, options)
    write_endpoints(endpoints, stack.replicas)
    stack.start()
    try:
        failing = stack.replicas[0]
        async with Traffic(stack.url) as traffic:
            await traffic.run_for(30)  # every replica serving
            sigterm_at = time.time()
            async with http_client.AsyncClient(timeout=5) as admin:
                response = await admin.post(f"http://{failing}/sim/shutdown", json={})
            assert response.status_code == 202, response.text
            deadline = time.monotonic() + LEARN_LATE_S
            while time.monotonic() < deadline:  # traffic keeps flowing while the picker does not know
                await traffic.run_for(1)
            learned_at = time.time()
            write_endpoints(endpoints, stack.replicas, draining=failing)
            await traffic.run_for(30)
        record = drain_record(stack, failing)
        refused = [
            r for r in stack.sim_requests(failing) if r["outcome"] == "shutdown-500"
        ]  # attempts the draining replica answered with its 500 (Envoy may have retried them)
        window = [result for started, result in traffic.results if sigterm_at <= started < learned_at]
        return {
            "requests": len(traffic.results),
            "client_500": sum(1 for _, r in traffic.results if r.status == 500),
            "failed": sum(1 for _, r in traffic.results if r.status != 200 or not r.done),
            "window_requests": len(window),
            "refused_attempts": len(refused),
            "refused_after_learning": sum(1 for r in refused if r["arrival"] > learned_at + 0.5),
            "suspected": stack.picker_value("picker_endpoint_suspected_total"),
            "failures_counted": stack.picker_value("picker_endpoint_failures_total"),
            "drain": record,
        }
    finally:
        stack.stop()


async def test_a_draining_replicas_500s_never_reach_clients_nor_attract_traffic(tmp_path: Path) -> None:
    seen = await late_learning(tmp_path, SHIPPED)
    print("late learning, shipped config:", json.dumps(seen, default=str))
    assert seen["client_500"] == 0, seen
    assert seen["failed"] == 0, seen
    assert seen["refused_attempts"] >= 3, seen  # the replica did refuse work: the scenario happened
    # suspect after 3 in a row: a handful of refusals (those already on their way), not the window's
    # share of traffic the lowest in-flight count would have sent it
    assert seen["suspected"] >= 1, seen
    # (the 1 s first backoff runs out once within the 2 s; the doubled one does not: at most 2 x 3,
    # plus those already dispatched when it turned suspect. Without suspects: 26, measured)
    assert seen["refused_attempts"] <= 2 * 3 + CONCURRENCY, seen
    assert seen["refused_after_learning"] == 0, seen
    drain = seen["drain"]
    assert drain is not None and drain["failed_before_start"] >= 3, seen  # the scorecard counts them
    assert drain["picks_after_start"] == 0, seen


async def test_without_500_retries_clients_see_the_drain_500(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same sequence with the pre-issue-13 retry codes: the failure the shipped config prevents."""
    template = SHAPES[SHIPPED].read_text()
    assert "retriable_status_codes: [500, 503]" in template
    variant = tmp_path / "envoy-503-only.yaml"
    variant.write_text(
        template.replace("retriable_status_codes: [500, 503]", "retriable_status_codes: [503]")
    )
    monkeypatch.setitem(SHAPES, "retry-503-only", variant)
    seen = await late_learning(tmp_path, "retry-503-only")
    print("late learning, 503-only retries:", json.dumps(seen, default=str))
    assert seen["client_500"] >= 1, seen
    assert seen["suspected"] >= 1, seen  # the 500s that reached clients made it suspect all the same
    assert seen["client_500"] <= 3 + CONCURRENCY, seen


async def test_streams_the_engine_stopped_sending_count_as_cut_when_the_client_leaves(tmp_path: Path) -> None:
    """vLLM at its --shutdown-timeout leaves the streams still running hanging: no more tokens. The
    clients give up on the silence; the drain record counts them `cut`, not `client-disconnect`."""
    endpoints = tmp_path / "endpoints.yaml"
    config = tmp_path / "picker.yaml"
    pool = {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}
    config.write_text(json.dumps({"pool": pool, "streams": {"cut_after_silence_s": 1.0}}))
    options = StackOptions(
        replicas=1,
        sim_args=("--ttft-ms", "20", "--itl-ms", "25", "--post-drain-close-s", "60"),
        picker_args=("--config", str(config)),
        static_endpoints=False,
    )
    stack = Stack(tmp_path, options)
    write_endpoints(endpoints, stack.replicas)
    stack.start()
    try:
        replica = stack.replicas[0]
        async with http_client.AsyncClient(timeout=10) as http:
            flowing = [asyncio.Event() for _ in range(3)]
            streams = [
                asyncio.create_task(
                    stream_request(
                        http,
                        stack.url + "/v1/completions",
                        completion_body(400),
                        read_timeout=2.5,
                        first_event=event,
                    )
                )
                for event in flowing
            ]  # ~10 s of tokens each; the client leaves after 2.5 s without one
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in flowing)), 20)
            write_endpoints(endpoints, stack.replicas, draining=replica)
            await asyncio.to_thread(
                wait_until, lambda: (drain_record(stack, replica) or {}).get("in_flight_at_start") == 3, 10
            )
            response = await http.post(
                f"http://{replica}/sim/shutdown", json={"timeout": 0.5, "on_drain_timeout": "hang"}
            )
            assert response.status_code == 202, response.text
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert all(r.events and not r.done for r in results), results  # tokens, then silence
        await asyncio.to_thread(
            wait_until, lambda: sum((drain_record(stack, replica) or {})["ended"].values()) == 3, 10
        )
        ended = (drain_record(stack, replica) or {})["ended"]
        print("streams abandoned by the engine, then left by their clients:", ended)
        assert ended["cut"] == 3 and ended["client-disconnect"] == 0, ended
    finally:
        stack.stop()
