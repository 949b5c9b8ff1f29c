"""Stream tracking through the real Envoy with fault-injecting simulators: the commit point, truncation
accounting, stalls, and a picker crash that cuts nothing. Disconnect aborts and the 1,000-request leak
check run against both frontends in tests/frontends/."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Result, completion_body, stream_one

pytestmark = pytest.mark.envoy

FAST = ("--ttft-ms", "5", "--itl-ms", "10")


@pytest.fixture(scope="module")
def fault_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = Stack(
        tmp_path_factory.mktemp("faults"),
        StackOptions(replicas=2, sim_args=FAST, picker_args=("--stall-after", "0.5")),
    ).start()
    try:
        yield stack
    finally:
        stack.stop()


def logged(stack: Stack) -> int:
    return sum(len(stack.sim_requests(r)) for r in stack.replicas)


def ends(stack: Stack, reason: str) -> float:
    return stack.picker_value("picker_request_ends_total", reason=reason)


async def test_reset_after_first_tokens_is_never_retried(fault_stack: Stack) -> None:
    stack = fault_stack
    before_logged, before_truncated = logged(stack), ends(stack, "upstream-truncated")
    async with http_client.AsyncClient(timeout=10) as client:
        result = await stream_one(client, stack.url, completion_body(20), {"x-sim-fault": "reset-after=3"})
    assert result.status == 200 and not result.done and result.chunks == 3  # truncated, once
    await asyncio.to_thread(wait_until, lambda: ends(stack, "upstream-truncated") == before_truncated + 1, 5)
    assert logged(stack) == before_logged + 1  # exactly one upstream attempt
    assert stack.picker_value("picker_endpoint_truncations_total", endpoint=result.replica) >= 1
    stack.wait_no_leaks()


async def test_vllm_silent_truncation_counts_as_truncated(fault_stack: Stack) -> None:
    # What a default-mode vLLM SIGTERM looks like: finish_reason "abort", usage, [DONE], HTTP 200.
    stack = fault_stack
    before = ends(stack, "upstream-truncated")
    async with http_client.AsyncClient(timeout=10) as client:
        holder = asyncio.create_task(stream_one(client, stack.url, completion_body(300)))
        await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == 1, 5)
        replica = next(
            r for r in stack.replicas if stack.picker_value("picker_endpoint_in_flight", endpoint=r)
        )
        # default-mode vLLM shutdown on that replica: in-flight streams end with "abort" + [DONE]
        await client.post(f"http://{replica}/sim/shutdown", json={})
        result = await holder
    assert result.status == 200 and result.done and result.finish_reason == "abort"
    await asyncio.to_thread(wait_until, lambda: ends(stack, "upstream-truncated") == before + 1, 5)
    stack.wait_no_leaks()
    # bring that replica back for the other tests of the module
    stack.sims.stop()  # type: ignore[union-attr]
    stack.start_sims()


async def test_error_event_is_counted_as_such(fault_stack: Stack) -> None:
    before = ends(fault_stack, "upstream-error-event")
    async with http_client.AsyncClient(timeout=10) as client:
        result = await stream_one(
            client, fault_stack.url, completion_body(10), {"x-sim-fault": "error-after=2"}
        )
    assert result.error == "error event" and result.done
    await asyncio.to_thread(wait_until, lambda: ends(fault_stack, "upstream-error-event") == before + 1, 5)
    fault_stack.wait_no_leaks()


# A streaming vLLM sends its 200 headers at admission, so a reset "before the first byte" is one
# before the headers of a non-streaming answer (or a refused connection, see test_failures.py).
@pytest.mark.parametrize(
    ("fault", "stream"),
    [({"status": 503}, True), ({"reset_after": 0}, False)],
    ids=["503-streaming", "reset-non-streaming"],
)
async def test_failure_before_the_first_byte_moves_to_the_fallback(
    tmp_path: Path, fault: dict[str, int], stream: bool
) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=2, sim_args=FAST, picker_args=("--no-scrape",))).start()
    try:
        bad, good = stack.replicas
        stack.set_fault(bad, **fault)
        async with http_client.AsyncClient(timeout=10) as client:
            # Equal endpoints are picked at random: send until the bad one was the primary twice.
            for _ in range(30):
                if stack.picker_value("picker_picks_total", endpoint=bad) >= 2:
                    break
                if stream:
                    result = await stream_one(client, stack.url, completion_body(5))
                    assert result.ok and result.replica == good and result.chunks == 5
                else:
                    response = await client.post(
                        stack.url + "/v1/completions", json=completion_body(5, stream=False)
                    )
                    assert response.status_code == 200 and response.headers["x-sim-replica"] == good
                    assert response.json()["usage"]["completion_tokens"] == 5
        assert stack.picker_value("picker_picks_total", endpoint=bad) >= 2
        await asyncio.to_thread(
            wait_until, lambda: stack.picker_value("picker_upstream_retries_total", endpoint=good) >= 2, 5
        )
        assert stack.picker_value("picker_fallback_served_total") >= 1
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_stalled_stream_is_detected_and_ended_by_the_client(fault_stack: Stack) -> None:
    stack = fault_stack
    before = stack.picker_value("picker_request_ends_total", reason="stalled")
    async with http_client.AsyncClient(timeout=10) as client:
        task = asyncio.create_task(
            stream_one(client, stack.url, completion_body(20), {"x-sim-fault": "stall-after=2"})
        )
        await asyncio.to_thread(
            wait_until,
            lambda: (
                sum(stack.picker_value("picker_endpoint_stalls_total", endpoint=r) for r in stack.replicas)
                >= 1
            ),
            5,
        )
        task.cancel()
    await asyncio.to_thread(wait_until, lambda: ends(stack, "stalled") == before + 1, 5)
    stack.wait_no_leaks()


@pytest.mark.parametrize("fail_open", [False, True], ids=["failClose", "failOpen"])
async def test_picker_crash_cuts_no_stream(tmp_path: Path, fail_open: bool) -> None:
    stack = Stack(
        tmp_path,
        StackOptions(replicas=3, sim_args=("--ttft-ms", "5", "--itl-ms", "20"), failure_mode_allow=fail_open),
    ).start()
    try:
        assert stack.picker is not None
        async with http_client.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=60)) as client:
            flowing = [asyncio.Event() for _ in range(50)]
            streams = [
                asyncio.create_task(stream_one(client, stack.url, completion_body(75), first_event=event))
                for event in flowing
            ]
            # Every stream has its first token, so its routing RPC is over. (A request the picker is
            # still routing when it dies follows the failure mode instead: a retryable 503 here.)
            await asyncio.wait_for(asyncio.gather(*(event.wait() for event in flowing)), 10)
            assert stack.picker_value("picker_in_flight") == 50
            stack.picker.kill()  # SIGKILL mid-stream
            newcomer: Result = await stream_one(client, stack.url, completion_body(3))
            finished = await asyncio.gather(*streams)
        assert [r for r in finished if not r.ok] == []
        if fail_open:
            assert newcomer.ok
        else:
            assert newcomer.status == 503 and not newcomer.replica
    finally:
        stack.stop()
