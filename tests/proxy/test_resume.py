"""Streams that survive their replica (issue 42): `picker proxy` continues a cut stream elsewhere.

Three simulated replicas, each in its own process (so one can be SIGKILLed), greedy tokens under
`return_token_ids` (the simulator's tokens are a function of their context, as greedy decoding's
are). A stream whose replica dies after its first token completes through another replica with the
text, token ids, finish_reason and usage of an uncut run of the same request; the client sees one
well-formed stream. What cannot be continued exactly is not, and says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from loadtest.procs import Proc, async_wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions

MODEL = "tiny-llama"
COMPLETION = {
    "model": MODEL, "prompt": "Tell me a long story about resumes.", "max_tokens": 200, "temperature": 0,
    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
}  # fmt: skip
CHAT = {
    "model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 120,
    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
}  # fmt: skip


def stack_options(resume: str = "greedy", **env: str) -> StackOptions:
    return StackOptions(
        replicas=3,
        sim_args=("--ttft-ms", "5", "--itl-ms", "8"),
        replica_args=((), (), ()),
        picker_env={"PICKER_STREAMS__RESUME": resume, **env},
    )


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    started = ProxyStack(tmp_path_factory.mktemp("resume"), stack_options()).start()
    try:
        yield started
    finally:
        started.stop()


def process_of(stack: ProxyStack, address: str) -> Proc:
    processes = [stack.sims, *stack.more_sims]
    proc = processes[stack.replicas.index(address)]
    assert proc is not None
    return proc


class Stream:
    """What a client read of one stream: its frames, and whether it ended well-formed."""

    def __init__(self) -> None:
        self.frames: list[dict[str, Any]] = []
        self.done = 0
        self.served = ""
        self.status = 0
        self.broken = False

    @property
    def text(self) -> str:
        out = []
        for frame in self.frames:
            for choice in frame.get("choices") or []:
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
        return "".join(out)

    @property
    def tokens(self) -> int:
        return sum(
            1
            for f in self.frames
            for c in f.get("choices") or []
            if c.get("text") or c.get("delta", {}).get("content")
        )

    @property
    def finish(self) -> list[str]:
        return [
            c["finish_reason"] for f in self.frames for c in f.get("choices") or [] if c.get("finish_reason")
        ]

    @property
    def usage(self) -> dict[str, Any] | None:
        found = [f["usage"] for f in self.frames if f.get("usage")]
        return found[-1] if found else None


async def read_stream(
    session: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any],
    headers: dict[str, str] | None = None, at: int | None = None, event: asyncio.Event | None = None,
    out: Stream | None = None,
) -> Stream:  # fmt: skip
    """One stream to its end; after `at` content frames, set `event` (the test's moment to strike)."""
    out = out or Stream()
    try:
        async with session.post(url + path, json=body, headers=headers or {}) as response:
            out.status, out.served = (
                response.status,
                response.headers.get("x-gateway-destination-endpoint-served", ""),
            )
            buffer = b""
            async for chunk in response.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event_bytes, buffer = buffer.split(b"\n\n", 1)
                    data = event_bytes.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        out.done += 1
                        continue
                    out.frames.append(json.loads(data))
                    if at is not None and event is not None and out.tokens >= at:
                        event.set()
            if buffer:
                out.broken = True
    except aiohttp.ClientPayloadError:
        out.broken = True
    return out


async def resumes(stack: ProxyStack) -> dict[str, float]:
    page = await asyncio.to_thread(stack.picker_metrics)
    return {
        dict(labels)["reason"]: v
        for (name, labels), v in page.items()
        if name == "picker_stream_resumes_total"
    }


CUTS = [
    ("/v1/completions", COMPLETION, 50), ("/v1/completions", COMPLETION, 1),
    ("/v1/completions", COMPLETION, 199), ("/v1/chat/completions", CHAT, 50),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "cut_at"), CUTS)
async def test_a_stream_whose_replica_is_killed_completes_elsewhere_token_for_token(
    stack: ProxyStack, path: str, body: dict[str, Any], cut_at: int
) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        uncut = await read_stream(session, stack.url, path, body)
        assert uncut.status == 200 and uncut.done == 1 and not uncut.broken
        strike, seen = asyncio.Event(), Stream()
        task = asyncio.create_task(
            read_stream(session, stack.url, path, body, at=cut_at, event=strike, out=seen)
        )
        await asyncio.wait_for(strike.wait(), 20)
        process_of(stack, seen.served).signal(signal.SIGKILL)  # the stream breaks off mid-sentence
        result = await asyncio.wait_for(task, 30)
    assert result.status == 200 and not result.broken and result.done == 1
    assert result.text == uncut.text and result.tokens == uncut.tokens
    assert result.finish == uncut.finish == ["length"]
    assert result.usage is not None and uncut.usage is not None
    assert result.usage["completion_tokens"] == uncut.usage["completion_tokens"]
    assert result.usage["prompt_tokens"] == uncut.usage["prompt_tokens"]
    assert len({f["id"] for f in result.frames}) == 1 and len({f["created"] for f in result.frames}) == 1
    assert all(
        "token_ids" not in (c or {}) or c["token_ids"] is None for f in result.frames for c in f["choices"]
    )
    counted = await resumes(stack)
    assert counted.get("upstream-reset", 0) + counted.get("upstream-truncated", 0) == 1, counted
    assert stack.picker is not None
    ends = [line for line in stack.picker.log_text().splitlines() if " resumed=1 " in line]
    assert len(ends) == 1 and "end=completed" in ends[0] and f"cut_on={seen.served}" in ends[0]


async def set_fault(replica: str, spec: dict[str, Any]) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{replica}/sim/faults", json=spec) as response:
            assert response.status == 200


async def test_an_error_event_is_resumed_twice_then_the_limit_lets_the_engine_s_error_through(
    stack: ProxyStack,
) -> None:
    """Every replica's next stream fails with vLLM's error event after 30 tokens: an 80-token answer
    needs two resumes (the limit) and completes; a 200-token one is cut a third time and the client
    gets the engine's error event, as it would have without resume."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        short = {**COMPLETION, "max_tokens": 80}
        uncut = await read_stream(session, stack.url, "/v1/completions", short)
        for replica in stack.replicas:
            await set_fault(replica, {"error-after": 30, "count": 1})
        result = await read_stream(session, stack.url, "/v1/completions", short)
        assert result.text == uncut.text and result.done == 1 and result.usage == uncut.usage
        assert (await resumes(stack)).get("upstream-error-event") == 2
        for replica in stack.replicas:
            await set_fault(replica, {"error-after": 30, "count": 1})
        long = await read_stream(session, stack.url, "/v1/completions", COMPLETION)
    assert long.tokens == 90 and long.done == 1 and "error" in long.frames[-1]
    assert (await resumes(stack)).get("limit") == 1


async def test_what_cannot_be_continued_exactly_is_cut_as_before(stack: ProxyStack) -> None:
    """Sampling under `greedy`, or a request that refuses with its header: a killed replica's
    stream reaches the client cut; a malformed header is a 400 with the contract's reason."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(
            stack.url + "/v1/completions", json=COMPLETION, headers={"x-picker-resume": "maybe"}
        ) as response:
            assert response.status == 400 and response.headers["x-picker-dropped-reason"] == "bad-request"
        asked = {**COMPLETION, "n": 2, "max_tokens": 2}
        async with session.post(
            stack.url + "/v1/completions", json=asked, headers={"x-picker-resume": "on"}
        ) as r:
            await r.read()
            assert r.headers.get("x-picker-resume-refused") == "several-choices"  # it asked: why not
        for body, headers in (
            ({**COMPLETION, "temperature": 0.8}, {}),
            (COMPLETION, {"x-picker-resume": "off"}),
        ):
            strike, seen = asyncio.Event(), Stream()
            task = asyncio.create_task(
                read_stream(session, stack.url, "/v1/completions", body, headers, 20, strike, seen)
            )
            await asyncio.wait_for(strike.wait(), 20)
            process_of(stack, seen.served).signal(signal.SIGKILL)
            result = await asyncio.wait_for(task, 30)
            assert result.broken and result.done == 0 and result.tokens < 200
    assert await resumes(stack) == {"not-resumable": 1.0}


async def test_fifty_streams_lose_nothing_when_one_of_three_replicas_is_killed(stack: ProxyStack) -> None:
    """50 concurrent greedy streams; one replica SIGKILLed while they run: every stream completes
    with all its tokens (without resume, every stream on that replica would be cut)."""
    body = {**COMPLETION, "max_tokens": 120}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        strike = asyncio.Event()
        tasks = [
            asyncio.create_task(read_stream(session, stack.url, "/v1/completions", body, at=40, event=strike))
            for _ in range(50)
        ]
        await asyncio.wait_for(strike.wait(), 20)
        victim = stack.replicas[0]
        process_of(stack, victim).signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    on_victim = sum(1 for r in results if r.served == victim)
    assert on_victim > 0  # the kill cut streams
    assert [r for r in results if r.broken or r.done != 1 or r.tokens != 120] == []
    assert len({r.text for r in results}) == 1  # the same greedy answer, every one
    counted = await resumes(stack)
    assert counted.get("upstream-reset", 0) + counted.get("upstream-truncated", 0) == on_victim, counted


async def admin(stack: ProxyStack, method: str, path: str) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{stack.metrics_port}{path}"
    async with aiohttp.ClientSession() as session, session.request(method, url) as response:
        return response.status, await response.json()


async def streams_then_drain(stack: ProxyStack, drain_query: str) -> tuple[list[Stream], str, float]:
    """20 greedy streams of 150 tokens at 40 ms a token (6 s each); once each has 10 tokens, drain
    the replica serving the most. Returns the streams, the replica and the drain's time to zero."""
    body, slow = {**COMPLETION, "max_tokens": 150}, {"x-sim-itl-ms": "40"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        seen = [Stream() for _ in range(20)]
        events = [asyncio.Event() for _ in seen]
        tasks = [
            asyncio.create_task(read_stream(session, stack.url, "/v1/completions", body, slow, 10, e, out))
            for e, out in zip(events, seen, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 20)
        victim = max(stack.replicas, key=lambda r: sum(s.served == r for s in seen))
        on_victim = sum(s.served == victim for s in seen)
        status, answer = await admin(stack, "POST", f"/admin/endpoints/{victim}/drain{drain_query}")
        assert status == 200, answer
        if drain_query:
            assert answer["moved_streams"] == on_victim

        deadline = asyncio.get_running_loop().time() + 10
        while (view := (await admin(stack, "GET", f"/admin/endpoints/{victim}"))[1]["endpoint"])["in_flight"]:
            assert asyncio.get_running_loop().time() < deadline, "the drained replica's streams never left"
            await asyncio.sleep(0.05)  # polling the admin API for a condition, bounded by the deadline
        record = view["drain"]
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    assert record["moved_away"] == on_victim and record["ended"]["cut"] == 0, record
    return results, victim, record["time_to_zero_s"]


async def test_a_drain_asked_to_move_streams_empties_its_replica_at_once(stack: ProxyStack) -> None:
    """POST .../drain?move_streams=true: the replica's streams continue elsewhere now; its drain
    closes in well under a second instead of the 5 s its longest answer had left; nothing is cut."""
    status, answer = await admin(
        stack, "POST", f"/admin/endpoints/{stack.replicas[0]}/drain?move_streams=maybe"
    )
    assert status == 400, answer
    results, _, to_zero = await streams_then_drain(stack, "?move_streams=true")
    assert to_zero < 2.0
    assert [r for r in results if r.broken or r.done != 1 or r.tokens != 150] == []
    assert len({r.text for r in results}) == 1


@pytest.fixture
def moving_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    options = stack_options(PICKER_STREAMS__MOVE_AFTER_S="1")
    started = ProxyStack(tmp_path_factory.mktemp("resume-move"), options).start()
    try:
        yield started
    finally:
        started.stop()


async def test_a_drain_past_its_deadline_moves_its_streams_instead_of_waiting(
    moving_stack: ProxyStack,
) -> None:
    """streams.move_after_s=1: a plain drain under 6-second streams reaches zero in flight about a
    second after it began (not at the streams' end), and every stream completes."""
    results, _, to_zero = await streams_then_drain(moving_stack, "")
    assert 1.0 <= to_zero < 3.0
    assert [r for r in results if r.broken or r.done != 1 or r.tokens != 150] == []


async def test_the_prestop_hook_moves_its_replicas_streams_and_returns_once_the_engine_is_idle(
    stack: ProxyStack, tmp_path: Path
) -> None:
    """`picker drain-wait --move-streams-url`: the hook asks the picker to move this replica's
    streams at its start, then waits for the engine's idle as before: it returns in about a second
    (the streams had 5 s left), and every stream completes."""
    body, slow = {**COMPLETION, "max_tokens": 150}, {"x-sim-itl-ms": "40"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        seen = [Stream() for _ in range(12)]
        events = [asyncio.Event() for _ in seen]
        tasks = [
            asyncio.create_task(read_stream(session, stack.url, "/v1/completions", body, slow, 10, e, out))
            for e, out in zip(events, seen, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 20)
        victim = max(stack.replicas, key=lambda r: sum(s.served == r for s in seen))
        on_victim = sum(s.served == victim for s in seen)
        move = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{victim}/drain?move_streams=true"
        argv = [
            sys.executable, "-m", "picker", "drain-wait", "--metrics-url", f"http://{victim}/metrics",
            "--move-streams-url", move, "--quiet-interval", "0.2", "--poll-interval", "0.05",
            "--deadline", "20",
        ]  # fmt: skip
        hook = Proc("drain-wait", argv, tmp_path / "drain-wait.log")
        try:
            code = await asyncio.to_thread(hook.wait_exit, 30)
        finally:
            hook.stop()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    summary = json.loads(hook.log_text().strip().splitlines()[-1])
    assert code == 0 and summary["move_streams"] == {"status": 200, "moved": on_victim}, summary
    assert summary["outcome"] == "idle" and summary["total_s"] < 4.0, summary
    assert [r for r in results if r.broken or r.done != 1 or r.tokens != 150] == []


@pytest.fixture
def stalling_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    options = stack_options(PICKER_STREAMS__STALL_AFTER_S="0.5")
    started = ProxyStack(tmp_path_factory.mktemp("resume-stall"), options).start()
    try:
        yield started
    finally:
        started.stop()


async def test_a_stream_that_stalls_continues_elsewhere(stalling_stack: ProxyStack) -> None:
    """A replica that stops sending without closing (streams.stall_after_s 0.5): the stream moves on.
    Every replica's next stream stalls after 30 tokens: an 80-token answer needs two moves."""
    stack = stalling_stack
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        body = {**COMPLETION, "max_tokens": 80}
        uncut = await read_stream(session, stack.url, "/v1/completions", body)
        for replica in stack.replicas:
            await set_fault(replica, {"stall-after": 30, "count": 1})
        result = await read_stream(session, stack.url, "/v1/completions", body)
    assert result.text == uncut.text and result.done == 1 and not result.broken
    assert result.usage == uncut.usage
    assert await resumes(stack) == {"stalled": 2.0}


async def test_a_stall_no_replica_will_take_keeps_the_stream_where_it_was(stalling_stack: ProxyStack) -> None:
    """A move opens the continuation before it ends the stalled part: when every replica refuses it
    (streams.resume_max tries), the part was never aborted, and a stall that was only brief finishes
    there as it would have without resume. Before: the part was aborted first, and the stream cut."""
    stack = stalling_stack
    body, slow = {**COMPLETION, "max_tokens": 80}, {"x-sim-itl-ms": "40"}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        uncut = await read_stream(session, stack.url, "/v1/completions", body)
        strike, seen = asyncio.Event(), Stream()
        task = asyncio.create_task(
            read_stream(session, stack.url, "/v1/completions", body, slow, 10, strike, seen)
        )
        await asyncio.wait_for(strike.wait(), 20)
        for replica in stack.replicas:
            if replica != seen.served:
                await set_fault(replica, {"status": 503, "count": 1})  # each refuses the continuation
        frozen = process_of(stack, seen.served)
        frozen.signal(signal.SIGSTOP)  # its replica stops sending, the connection open
        try:
            async with asyncio.timeout(20):
                while True:  # until both replicas were tried, and refused it
                    if (await resumes(stack)).get("failed", 0) >= 1:
                        break
                    await asyncio.sleep(0.05)  # a poll of the picker's count, not a synchronisation
        finally:
            frozen.signal(signal.SIGCONT)  # the stall was only brief
        result = await asyncio.wait_for(task, 30)
    assert result.status == 200 and not result.broken and result.done == 1
    assert result.text == uncut.text and result.usage == uncut.usage
    counted = await resumes(stack)
    assert "stalled" not in counted and counted.get("failed") == 1, counted


@contextlib.asynccontextmanager
async def streaming_from_a_file(
    tmp_path: Path,
) -> AsyncIterator[tuple[ProxyStack, Path, asyncio.Task[Any], Stream]]:
    """A proxy over three replicas listed in an endpoints file (stalls after 0.5 s), with one slow
    80-token stream under way (its first 10 tokens read): the stack, the file, the stream's task
    and what it has seen. Stops the stack on exit."""
    listed = tmp_path / "endpoints.yaml"
    args = ("--endpoints-file", str(listed), "--endpoints-file-poll", "0.1")
    options = replace(
        stack_options(PICKER_STREAMS__STALL_AFTER_S="0.5"), static_endpoints=False, picker_args=args
    )
    stack = ProxyStack(tmp_path, options)
    try:
        stack.start_sims()
        listed.write_text("endpoints:\n" + "".join(f"  - {r}\n" for r in stack.replicas))
        stack.start_picker()
        body, slow = {**COMPLETION, "max_tokens": 80}, {"x-sim-itl-ms": "40"}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            strike, seen = asyncio.Event(), Stream()
            task = asyncio.create_task(
                read_stream(session, stack.url, "/v1/completions", body, slow, 10, strike, seen)
            )
            await asyncio.wait_for(strike.wait(), 20)
            yield stack, listed, task, seen
    finally:
        stack.stop()


async def ended(task: asyncio.Task[Any], when: str) -> Any:
    """The stream's own end, within 10 s; the check fails, saying `when`, if it never comes."""
    try:
        return await asyncio.wait_for(task, 10)
    except TimeoutError:
        pytest.fail(f"the client's stream never ended {when}")


async def test_a_kept_stall_whose_replica_is_removed_ends_the_stream(tmp_path: Path) -> None:
    """A stall kept because every replica refused its continuation (its tries spent) and whose
    replica then leaves the pool (GONE) will never send again: its part is ended and the stream cut,
    within a bound. Before: the move was refused as spent, the record ended (slot released, counted
    cut), and nothing closed the part: the client's stream hung in the relay's read."""
    async with streaming_from_a_file(tmp_path) as (stack, listed, task, seen):
        for replica in stack.replicas:
            if replica != seen.served:
                await set_fault(replica, {"status": 503, "count": 1})  # each refuses the continuation
        frozen = process_of(stack, seen.served)
        frozen.signal(signal.SIGSTOP)  # silent, its connection open: kept, its tries spent
        try:
            async with asyncio.timeout(20):
                while True:  # until both other replicas were tried, and refused it
                    if (await resumes(stack)).get("failed", 0) >= 1:
                        break
                    await asyncio.sleep(0.05)  # a poll of the picker's count, not a synchronisation
            kept = [r for r in stack.replicas if r != seen.served]
            listed.write_text("endpoints:\n" + "".join(f"  - {r}\n" for r in kept))  # now GONE
            result = await ended(task, "after its replica left the pool")
        finally:
            frozen.signal(signal.SIGCONT)
    assert result.status == 200 and result.broken and result.done == 0
    assert 10 <= result.tokens < 80


async def test_a_stall_on_a_replica_already_gone_with_nowhere_to_go_ends_the_stream(tmp_path: Path) -> None:
    """The stream's replica leaves the pool and every other one drains before the stream goes silent:
    the stall is found with no replica free to take it. Before, the sweep ended the record (slot
    released) and told the frontend nothing: the client's stream hung on the silent connection."""
    async with streaming_from_a_file(tmp_path) as (stack, listed, task, seen):
        others = [r for r in stack.replicas if r != seen.served]
        draining = "".join(f'  - {{address: "{r}", draining: true}}\n' for r in others)
        listed.write_text("endpoints:\n" + draining)  # the served one gone, the others draining

        def read() -> bool:
            page = stack.picker_metrics()
            states = {
                dict(labels)["endpoint"]: dict(labels)["state"]
                for (name, labels), value in page.items()
                if name == "picker_endpoint_state" and value == 1
            }
            return all(states.get(r) == "draining" for r in others)

        await async_wait_until(read, 10, 0.05, "the picker to read the endpoints file")
        frozen = process_of(stack, seen.served)
        frozen.signal(signal.SIGSTOP)
        try:
            result = await ended(task, "with its replica gone and nowhere to move")
        finally:
            frozen.signal(signal.SIGCONT)
    assert result.broken and result.done == 0


def envoy_in_front(proxy: str, workdir: Path) -> tuple[Proc, int]:
    """Envoy with the shipped route (its retries before the first byte) and no ext_proc, its pool one
    `picker proxy`: a gateway in front of the proxy, the shape the guide gives for pools that want
    resume (Envoy cannot re-issue a request mid-response; the proxy behind it can)."""
    import yaml

    from loadtest.procs import free_port, port_open
    from loadtest.stack import health_ok
    from picker.cli.envoyconf import EnvoyParams, envoy_binary, render

    listen, admin_port = free_port(), free_port()
    params = EnvoyParams(listen, admin_port, free_port(), [proxy], eds=False, picker_tls=False)
    config = yaml.safe_load(render(params))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if not f["name"].startswith("envoy.filters.http.ext_proc")
    ]
    path = workdir / "envoy-front.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [
        envoy_binary(),
        "-c",
        str(path),
        "--use-dynamic-base-id",
        "--log-level",
        "warn",
        "--concurrency",
        "1",
    ]
    proc = Proc("envoy-front", argv, workdir / "envoy-front.log")
    proc.wait_ready(lambda: health_ok(admin_port, "/ready") and port_open(listen), timeout=30)
    return proc, listen


@pytest.mark.envoy
async def test_behind_envoy_a_stream_whose_replica_dies_still_completes(
    stack: ProxyStack, tmp_path: Path
) -> None:
    """The real Envoy in front of `picker proxy`: the client talks to Envoy, the proxy continues the
    stream of a SIGKILLed replica, and what reaches the client through Envoy is the uncut answer."""
    envoy, port = await asyncio.to_thread(envoy_in_front, f"127.0.0.1:{stack.listen_port}", tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            uncut = await read_stream(session, url, "/v1/completions", COMPLETION)
            strike, seen = asyncio.Event(), Stream()
            task = asyncio.create_task(
                read_stream(session, url, "/v1/completions", COMPLETION, None, 50, strike, seen)
            )
            await asyncio.wait_for(strike.wait(), 20)
            process_of(stack, seen.served).signal(signal.SIGKILL)
            result = await asyncio.wait_for(task, 30)
    finally:
        envoy.stop()
    assert uncut.done == 1 and result.done == 1 and not result.broken
    assert result.text == uncut.text and result.usage == uncut.usage
    assert (await resumes(stack)).get("upstream-reset", 0) + (await resumes(stack)).get(
        "upstream-truncated", 0
    ) == 1
