"""The OpenAI Python SDK, as users run it, through Envoy + picker: streaming and not, its error objects,
its built-in retries against the picker's Retry-After, and a client that gives up mid-request.

Every SDK attempt is recorded by httpx event hooks on the SDK's own HTTP client (request sent,
response status, Retry-After, the picker's dropped-reason), keyed by a per-call test header.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Result, completion_body, stream_one

pytestmark = pytest.mark.envoy

MODEL = "tiny-llama"
CALL_HEADER = "x-test-call"


@dataclass
class Attempt:
    sent: float
    status: int = 0
    answered: float = 0.0
    retry_after: str = ""
    reason: str = ""


@dataclass
class AttemptLog:
    """Each SDK call's attempts in order, from hooks on the SDK's HTTP client."""

    calls: dict[str, list[Attempt]] = field(default_factory=lambda: defaultdict(list))

    async def on_request(self, request: Any) -> None:
        self.calls[request.headers.get(CALL_HEADER, "")].append(Attempt(sent=time.monotonic()))

    async def on_response(self, response: Any) -> None:
        attempt = self.calls[response.request.headers.get(CALL_HEADER, "")][-1]
        attempt.status = response.status_code
        attempt.answered = time.monotonic()
        attempt.retry_after = response.headers.get("retry-after", "")
        attempt.reason = response.headers.get("x-picker-dropped-reason", "")


def sdk(stack: Stack, log: AttemptLog | None = None, **options: Any) -> openai.AsyncOpenAI:
    hooks = {"request": [log.on_request], "response": [log.on_response]} if log else {}
    return openai.AsyncOpenAI(
        base_url=stack.url + "/v1",
        api_key="not-needed",
        http_client=openai.DefaultAsyncHttpxClient(event_hooks=hooks),
        **options,
    )


async def test_streaming_and_non_streaming_completions(stack: Stack) -> None:
    async with sdk(stack) as client:
        completion = await client.completions.create(model=MODEL, prompt="Say hi.", max_tokens=7)
        assert completion.choices[0].finish_reason == "length"
        assert completion.usage is not None and completion.usage.completion_tokens == 7

        chunks = [
            chunk
            async for chunk in await client.completions.create(
                model=MODEL, prompt="Say hi.", max_tokens=9, stream=True
            )
        ]
        assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 9
        assert chunks[-1].choices[0].finish_reason == "length"

        chat = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        deltas = [c.choices[0].delta.content async for c in chat if c.choices and c.choices[0].delta.content]
        assert len(deltas) == 5
    stack.wait_no_leaks()


async def test_the_sdk_error_objects_carry_the_pickers_message(tmp_path: Path) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=1, picker_args=("--max-body-bytes", "4096"))).start()
    try:
        async with sdk(stack, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as bad:
                # The SDK sends what it is given: a string max_tokens reaches the picker as such.
                await client.completions.create(model=MODEL, prompt="hi", max_tokens="ten")  # type: ignore[arg-type]
            with pytest.raises(openai.APIStatusError) as large:
                await client.completions.create(model=MODEL, prompt="x" * 8000, max_tokens=1)
        assert bad.value.status_code == 400
        assert bad.value.message.endswith("'max_tokens' must be an integer")
        assert bad.value.response.headers["x-picker-dropped-reason"] == "bad-request"
        assert isinstance(bad.value.body, dict) and bad.value.body["reason"] == "bad-request"
        assert large.value.status_code == 413
        # Envoy's own buffer limit or the picker's body limit: either way the contract's 413 body.
        assert isinstance(large.value.body, dict) and large.value.body["reason"] == "too-large"
        assert large.value.message.endswith(large.value.body["message"])
        assert large.value.body["message"].startswith("request body is")
        assert large.value.response.headers["x-picker-dropped-reason"] == "too-large"
    finally:
        stack.stop()


def busy_stack(tmp: Path, slots: int, engine_queue: int, picker_args: tuple[str, ...] = ()) -> Stack:
    """One replica with `slots` running slots and `engine_queue` waiting places; the picker knows both."""
    sim_args = ("--ttft-ms", "10", "--itl-ms", "25", "--max-num-seqs", str(slots))
    sim_args += ("--max-num-queued-reqs", str(engine_queue))
    args = (
        "--engine-slots",
        str(slots),
        "--waiting-threshold",
        str(engine_queue),
        "--scrape-interval",
        "0.05",
    )
    return Stack(tmp, StackOptions(replicas=1, sim_args=sim_args, picker_args=(*args, *picker_args))).start()


@pytest.fixture
def saturable(tmp_path: Path) -> Iterator[Stack]:
    stack = busy_stack(tmp_path, slots=1, engine_queue=1, picker_args=("--max-queued", "1"))
    try:
        yield stack
    finally:
        stack.stop()


async def hold(
    client: httpx.AsyncClient, stack: Stack, count: int, tokens: int
) -> list[asyncio.Task[Result]]:
    """`count` streams of `tokens` tokens, returned once the picker has them all in flight."""
    tasks = [
        asyncio.create_task(stream_one(client, stack.url, completion_body(tokens))) for _ in range(count)
    ]
    await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") == count, 10)
    return tasks


def assert_waited_as_told(attempts: list[Attempt]) -> None:
    """After every answer with Retry-After N, the SDK's next attempt came no sooner than N s later."""
    for answer, retry in itertools.pairwise(attempts):
        if answer.retry_after:
            assert retry.sent - answer.answered >= float(answer.retry_after) - 0.05, (answer, retry)


async def test_sdk_retries_honour_retry_after_on_429(saturable: Stack) -> None:
    stack, log = saturable, AttemptLog()
    async with http_client.AsyncClient(timeout=30) as raw, sdk(stack, log, max_retries=5) as client:
        holders = await hold(raw, stack, 2, tokens=40)  # the slot and the engine's queue place: ~1 s
        queued = asyncio.create_task(
            client.completions.create(
                model=MODEL, prompt="a", max_tokens=2, extra_headers={CALL_HEADER: "queued"}
            )
        )
        await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == 1, 10)
        refused = await client.completions.create(
            model=MODEL, prompt="b", max_tokens=2, extra_headers={CALL_HEADER: "refused"}
        )
        assert (await queued).choices[0].finish_reason == "length"
        assert all(r.ok for r in await asyncio.gather(*holders))
    assert refused.choices[0].finish_reason == "length"
    attempts = log.calls["refused"]
    assert (attempts[0].status, attempts[0].reason, attempts[0].retry_after) == (
        429,
        "rejected-saturated",
        "1",
    )
    assert attempts[-1].status == 200
    assert_waited_as_told(attempts)
    stack.wait_no_leaks()


async def test_picker_sigterm_with_queued_sdk_calls_ends_in_success_after_retries(tmp_path: Path) -> None:
    """The picker is replaced (SIGTERM, then a new one on the same port, as a Deployment would do): its
    queued requests get 503 + Retry-After; the SDK waits and retries until the new picker serves them."""
    stack = busy_stack(
        tmp_path, slots=2, engine_queue=1, picker_args=("--drain-timeout", "15", "--propagation", "1")
    )
    log, calls = AttemptLog(), 4
    try:
        assert stack.picker is not None
        async with http_client.AsyncClient(timeout=30) as raw, sdk(stack, log, max_retries=10) as client:
            holders = await hold(raw, stack, 3, tokens=60)  # ~1.5 s each: the old picker waits for them
            pending = [
                asyncio.create_task(
                    client.completions.create(
                        model=MODEL, prompt="q", max_tokens=3, extra_headers={CALL_HEADER: str(i)}
                    )
                )
                for i in range(calls)
            ]
            await asyncio.to_thread(wait_until, lambda: stack.picker_queued() == calls, 10)
            stack.picker.signal(signal.SIGTERM)
            assert await asyncio.to_thread(stack.picker.wait_exit, 30) == 0
            await asyncio.to_thread(stack.start_picker)  # the replacement, on the same ports
            results = await asyncio.gather(*pending)  # an SDK error here fails the test
            assert all(r.ok for r in await asyncio.gather(*holders))
        assert [r.choices[0].finish_reason for r in results] == ["length"] * calls
        for i in range(calls):
            attempts = log.calls[str(i)]
            first = attempts[0]
            assert (first.status, first.reason) == (503, "rejected-shutting-down"), attempts
            assert int(first.retry_after) >= 1
            assert attempts[-1].status == 200
            assert_waited_as_told(attempts)
        stack.wait_no_leaks()
    finally:
        stack.stop()


def replica_log(stack: Stack) -> list[dict[str, Any]]:
    return [entry for replica in stack.replicas for entry in stack.sim_requests(replica)]


def clear_replica_logs(stack: Stack) -> None:
    for replica in stack.replicas:
        http_client.delete(f"http://{replica}/sim/requests", timeout=5).raise_for_status()


async def test_sdk_cancel_and_timeout_abort_the_request_at_the_replica(stack: Stack) -> None:
    await asyncio.to_thread(clear_replica_logs, stack)
    async with sdk(stack, max_retries=0) as client:
        stream = await client.completions.create(model=MODEL, prompt="long", max_tokens=400, stream=True)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break
        await stream.close()  # the user pressed stop
    await asyncio.to_thread(
        wait_until, lambda: [e["outcome"] for e in replica_log(stack)] == ["aborted"], 10, 0.05, "the abort"
    )

    await asyncio.to_thread(clear_replica_logs, stack)
    async with sdk(stack, max_retries=0, timeout=0.5) as client:
        with pytest.raises(openai.APITimeoutError):
            await client.completions.create(
                model=MODEL, prompt="slow", max_tokens=5, extra_headers={"x-sim-ttft-ms": "5000"}
            )
    await asyncio.to_thread(
        wait_until, lambda: [e["outcome"] for e in replica_log(stack)] == ["aborted"], 10, 0.05, "the abort"
    )
    stack.wait_no_leaks()
