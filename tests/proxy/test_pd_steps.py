"""`picker proxy` runs a prefill / decode pair's two steps itself (proxy.pd_steps: proxy), as vLLM's P/D
proxy examples do, in front of simulator replicas playing vLLM's NixlConnector (pull mode): the prefill
step on the prefill replica, then the decode carrying its kv_transfer_params, which pulls the KV; a
failed step before the first byte is sent again without params (the decode computes the prompt),
counted; a client that leaves reaches the engine running its request; the prefill's lease ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from loadtest import http_client
from loadtest.procs import free_port, wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions
from loadtest.traffic import REPLICA_HEADER, completion_body, stream_one

ROLES = ("prefill", "decode")
_SEQ = itertools.count()
LONG = "Summarise the report below in three paragraphs, citing each table. " * 40  # ~700 tokens


def pd_proxy(
    workdir: Path, *config: tuple[str, Any], prefill_at: str | None = None, roles: tuple[str, ...] = ROLES
) -> ProxyStack:
    """One prefill and one decode replica, each its own process, behind `picker proxy` reading an
    endpoints file that names their roles (`prefill_at`: another prefill replica listed instead of
    the simulator's). No scrapes: a stopped replica stays in the pool."""
    workdir.mkdir(parents=True, exist_ok=True)
    endpoints = workdir / "endpoints.yaml"
    picker = {"pool": {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}}
    for group, values in config:
        picker[group] = values
    (workdir / "picker.yaml").write_text(json.dumps(picker))
    options = StackOptions(
        replicas=len(roles),
        sim_args=("--ttft-ms", "20", "--itl-ms", "10", "--kv-transfer-ms", "5"),
        picker_args=("--config", str(workdir / "picker.yaml"), "--no-scrape"),
        static_endpoints=False,
        replica_args=tuple(("--role", role) for role in roles),
    )
    stack = ProxyStack(workdir, options)
    listed = [prefill_at or stack.replicas[0], *stack.replicas[1:]]
    entries = [{"address": a, "role": r} for a, r in zip(listed, roles, strict=True)]
    endpoints.write_text(json.dumps(entries))
    return stack.start()


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    stack = pd_proxy(tmp_path_factory.mktemp("pd-proxy"))
    try:
        yield stack
    finally:
        stack.stop()


def long_body(stream: bool, tokens: int = 6) -> dict[str, Any]:
    """A prompt no replica holds yet (each its own start), long enough for the prefill hop."""
    return {**completion_body(tokens, stream=stream), "prompt": f"{next(_SEQ)} {LONG}"}


def kv_state(replica: str) -> dict[str, Any]:
    return dict(http_client.get(f"http://{replica}/sim/state", timeout=5).json()["kv_transfer"])


def pulls_pending(stack: ProxyStack) -> list[int]:
    view = http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()
    return [e["kv_pulls_pending"] for e in view["endpoints"]]


def clear(stack: ProxyStack) -> None:
    for replica in stack.replicas:
        http_client.delete(f"http://{replica}/sim/requests", timeout=5)
        http_client.delete(f"http://{replica}/sim/faults", timeout=5)


async def test_a_stream_and_a_plain_request_go_through_both_steps(pair: ProxyStack) -> None:
    prefill, decode = pair.replicas
    clear(pair)
    pulled = kv_state(prefill)["pulled"]
    async with http_client.AsyncClient(timeout=30) as client:
        streamed = await stream_one(client, pair.url, long_body(True))
        plain = await client.post(pair.url + "/v1/completions", json=long_body(False))
    assert streamed.status == 200 and streamed.done and streamed.chunks >= 1, streamed
    assert streamed.replica == decode  # the prefill replica is never the destination
    assert plain.status_code == 200 and plain.headers[REPLICA_HEADER] == decode, plain.text
    answer = plain.json()
    assert (
        answer["usage"]["completion_tokens"] == 6
    )  # the decode's tokens alone: the prefill's one is not sent
    assert not answer.get("kv_transfer_params"), answer  # no hand-off artefact reaches the client
    assert "x-prefiller-host-port" not in plain.headers
    # one prefill step per request on the prefill replica: one token, not streamed, its KV pulled
    steps = pair.sim_requests(prefill)
    assert len(steps) == 2 and all(s["tokens_sent"] == 1 and not s["stream"] for s in steps), steps
    assert kv_state(prefill)["pulled"] == pulled + 2
    assert kv_state(prefill)["held_requests"] == 0
    decoded = pair.sim_requests(decode)
    assert [d["stream"] for d in decoded] == [True, False] and all(
        d["outcome"] == "completed" for d in decoded
    )
    assert all(d.get("prefiller") is None for d in decoded)  # the proxy did the step: no header for a sidecar
    assert kv_state(decode)["pulls_failed"] == 0
    wait_until(lambda: pulls_pending(pair) == [0, 0], 5, what="the prefill leases to end")
    assert pair.picker_value("picker_pd_picks_total", how="pair") >= 2
    pair.wait_no_leaks()


async def test_a_decode_that_fails_its_pull_is_sent_again_without_params(pair: ProxyStack) -> None:
    decode = pair.replicas[1]
    clear(pair)
    before = pair.picker_value("picker_pd_recomputes_total", why="pull-failed")
    async with http_client.AsyncClient(timeout=30) as client:
        # the decode's first answer is a 500 (vLLM's failed pull, policy fail); then one stream whose
        # first event is the error event vLLM writes when the stream had already started
        await client.post(f"http://{decode}/sim/faults", json={"status": 500, "count": 1})
        plain = await client.post(pair.url + "/v1/completions", json=long_body(False))
        await client.post(f"http://{decode}/sim/faults", json={"error-after": 0, "count": 1})
        streamed = await stream_one(client, pair.url, long_body(True))
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 6, plain.text
    assert streamed.status == 200 and streamed.done and not streamed.error, streamed
    assert pair.picker_value("picker_pd_recomputes_total", why="pull-failed") == before + 2
    outcomes = [d["outcome"] for d in pair.sim_requests(decode)]
    assert outcomes.count("completed") == 2 and len(outcomes) == 4, outcomes
    wait_until(lambda: pulls_pending(pair) == [0, 0], 5, what="the prefill leases to end")
    pair.wait_no_leaks()


async def test_a_client_that_leaves_during_the_decode_aborts_it(pair: ProxyStack) -> None:
    prefill, decode = pair.replicas
    clear(pair)
    async with http_client.AsyncClient(timeout=30) as client:
        flowing = asyncio.Event()
        task = asyncio.create_task(stream_one(client, pair.url, long_body(True, 3000), first_event=flowing))
        await asyncio.wait_for(flowing.wait(), 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    wait_until(lambda: pair.sim_requests(decode)[-1]["outcome"] == "aborted", 5, what="the decode's abort")
    assert [s["outcome"] for s in pair.sim_requests(prefill)] == ["completed"]
    wait_until(lambda: pulls_pending(pair) == [0, 0], 5, what="the prefill lease to end")
    pair.wait_no_leaks()


async def test_a_client_that_leaves_during_the_prefill_step_aborts_it_and_sends_no_decode(
    pair: ProxyStack,
) -> None:
    prefill, decode = pair.replicas
    clear(pair)
    async with http_client.AsyncClient(timeout=30) as client:
        await client.post(f"http://{prefill}/sim/faults", json={"slow-headers": 10000, "count": 1})
        task = asyncio.create_task(client.post(pair.url + "/v1/completions", json=long_body(False)))
        arrived = lambda: len(pair.sim_requests(prefill)) == 1  # noqa: E731
        await asyncio.to_thread(wait_until, arrived, 5, what="the prefill step to arrive")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    wait_until(lambda: pair.sim_requests(prefill)[0]["end"] is not None, 5, what="the prefill's abort")
    assert pair.sim_requests(prefill)[0]["outcome"] == "aborted"
    assert pair.sim_requests(decode) == []  # no decode was ever sent
    wait_until(lambda: pulls_pending(pair) == [0, 0], 5, what="the prefill lease to end")
    pair.wait_no_leaks()


async def test_a_stopped_prefill_replica_leaves_the_decode_to_compute_the_prompt(tmp_path: Path) -> None:
    stack = pd_proxy(tmp_path)
    try:
        assert stack.sims is not None
        stack.sims.stop()  # the prefill replica's process, by its PID; the pool still lists it
        decode = stack.replicas[1]
        async with http_client.AsyncClient(timeout=30) as client:
            streamed = await stream_one(client, stack.url, long_body(True))
            plain = await client.post(stack.url + "/v1/completions", json=long_body(False))
        assert streamed.status == 200 and streamed.done and streamed.replica == decode, streamed
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 6, plain.text
        assert stack.picker_value("picker_pd_recomputes_total", why="prefill-unreachable") == 2
        assert [d["outcome"] for d in stack.sim_requests(decode)] == ["completed", "completed"]
        assert kv_state(decode)["pulls_failed"] == 0  # sent without params: nothing to pull
        wait_until(lambda: pulls_pending(stack) == [0, 0], 5, what="the prefill leases to end")
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_the_sidecar_setting_names_the_prefill_replica_to_the_decode_instead(tmp_path: Path) -> None:
    stack = pd_proxy(tmp_path, ("proxy", {"pd_steps": "sidecar"}))
    try:
        prefill, decode = stack.replicas
        async with http_client.AsyncClient(timeout=30) as client:
            plain = await client.post(stack.url + "/v1/completions", json=long_body(False))
        assert plain.status_code == 200, plain.text
        assert stack.sim_requests(prefill) == []  # the proxy sent no prefill step
        (decoded,) = stack.sim_requests(decode)
        assert decoded.get("prefiller", prefill) == prefill  # the header, for the sidecar in front of it
        wait_until(lambda: pulls_pending(stack) == [0, 0], 5, what="the prefill lease to end")
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_a_prefill_answer_without_usable_params_is_a_failed_step(tmp_path: Path) -> None:
    """A prefill replica answering 200 without NixlConnector's fields, then with a 503: each a failed
    step, counted by why; the decode computes the prompt and the request succeeds."""
    answers = [
        web.json_response({"choices": [], "kv_transfer_params": {"do_remote_prefill": True}}),
        web.json_response({"error": {"message": "busy", "code": 503}}, status=503),
    ]

    async def prefill(request: web.Request) -> web.Response:
        await request.read()
        return answers.pop(0)

    app = web.Application()
    app.router.add_post("/v1/completions", prefill)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        stack = await asyncio.to_thread(pd_proxy, tmp_path, prefill_at=f"127.0.0.1:{port}")
        try:
            async with http_client.AsyncClient(timeout=30) as client:
                for _ in range(2):
                    plain = await client.post(stack.url + "/v1/completions", json=long_body(False))
                    assert plain.status_code == 200, plain.text
            assert answers == []
            assert stack.picker_value("picker_pd_recomputes_total", why="prefill-bad-params") == 1
            assert stack.picker_value("picker_pd_recomputes_total", why="prefill-status") == 1
            await asyncio.to_thread(stack.wait_no_leaks)
        finally:
            stack.stop()
    finally:
        await runner.cleanup()


async def test_a_resumed_decode_stream_continues_without_a_prefill_step_or_params(tmp_path: Path) -> None:
    """The decode replica streaming a paired request is killed mid-stream: the stream continues on the
    other decode replica from the text already sent, with no second prefill step and no params (a
    continuation carrying the first decode's params would try a pull of KV already pulled, and fail)."""
    stack = pd_proxy(tmp_path, ("streams", {"resume": "greedy"}), roles=("prefill", "decode", "decode"))
    try:
        prefill, decodes = stack.replicas[0], stack.replicas[1:]
        async with http_client.AsyncClient(timeout=30) as client:
            flowing = asyncio.Event()
            task = asyncio.create_task(
                stream_one(client, stack.url, {**long_body(True, 200), "temperature": 0}, first_event=flowing)
            )
            await asyncio.wait_for(flowing.wait(), 10)
            serving = next(d for d in decodes if stack.sim_requests(d))
            # by its PID, mid-stream: the stream breaks off, as a crashed engine's would
            stack.more_sims[stack.replicas.index(serving) - 1].signal(signal.SIGKILL)
            result = await asyncio.wait_for(task, 30)
        assert result.status == 200 and result.done and result.finish_reason == "length", result
        (other,) = [d for d in decodes if d != serving]
        assert [r["outcome"] for r in stack.sim_requests(other)] == ["completed"]
        assert kv_state(other)["pulls_failed"] == 0
        assert len(stack.sim_requests(prefill)) == 1 and kv_state(prefill)["pulled"] == 1
        assert stack.picker_value("picker_pd_recomputes_total", why="pull-failed") == 0
        wait_until(lambda: pulls_pending(stack) == [0, 0, 0], 5, what="the prefill lease to end")
        stack.wait_no_leaks()
    finally:
        stack.stop()
