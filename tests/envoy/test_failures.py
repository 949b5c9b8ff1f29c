"""What clients see when things go wrong, through the real Envoy: bad input, dead replicas,
forged routing headers, and the picker itself down (failClose / failOpen)."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.procs import free_port, wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import REPLICA_HEADER, completion_body, stream_one
from picker.cli.envoyconf import EnvoyParams, envoy_binary, render

pytestmark = pytest.mark.envoy

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def small_limit_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    options = StackOptions(picker_args=("--max-body-bytes", str(LIMIT)))
    stack = Stack(tmp_path_factory.mktemp("limits"), options).start()
    try:
        yield stack
    finally:
        stack.stop()


BAD_INPUTS = [
    ("not-json", b"{this is not json", "application/json", 400, "bad-request"),
    (
        "no-model",
        json.dumps({"prompt": "x", "max_tokens": 1}).encode(),
        "application/json",
        400,
        "bad-request",
    ),
    ("array", b"[1,2,3]", "application/json", 400, "bad-request"),
    ("wrong-type", json.dumps({"model": "tiny-llama"}).encode(), "text/plain", 400, "bad-request"),
    (
        "too-large",
        json.dumps({"model": "tiny-llama", "prompt": "x" * (LIMIT + 10)}).encode(),
        "application/json",
        413,
        "too-large",
    ),
]


@pytest.mark.parametrize(
    ("body", "content_type", "status", "reason"),
    [case[1:] for case in BAD_INPUTS],
    ids=[case[0] for case in BAD_INPUTS],
)
async def test_bad_input_gets_status_json_and_reason(
    small_limit_stack: Stack, body: bytes, content_type: str, status: int, reason: str
) -> None:
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.post(
            small_limit_stack.url + "/v1/completions", content=body, headers={"content-type": content_type}
        )
        assert response.status_code == status
        assert response.headers["x-picker-dropped-reason"] == reason
        assert response.headers["content-type"] == "application/json"
        error = response.json()["error"]
        assert error["code"] == status and error["message"]
        assert REPLICA_HEADER not in response.headers  # no replica was contacted
        # ... and the picker keeps serving
        good = await stream_one(client, small_limit_stack.url, completion_body(3))
    assert good.ok
    small_limit_stack.wait_no_leaks()


async def test_dead_replica_listed_first_is_skipped_by_envoy(tmp_path: Path) -> None:
    dead = f"127.0.0.1:{free_port()}"
    # In-flight scheduling only: with scraping, the dead endpoint's failed /metrics would already keep
    # it from being primary. This checks Envoy's walk down the list when the picker could not know.
    stack = Stack(
        tmp_path, StackOptions(replicas=1, extra_envoy_endpoints=[dead], picker_args=("--no-scrape",))
    )
    stack.options.picker_endpoints = [*stack.replicas, dead]
    stack.start()
    try:
        async with http_client.AsyncClient(timeout=20) as client:
            # One long stream holds the live replica, so least-in-flight must put the dead one first.
            holder = asyncio.create_task(stream_one(client, stack.url, completion_body(60)))
            await asyncio.to_thread(
                wait_until,
                lambda: stack.picker_value("picker_endpoint_in_flight", endpoint=stack.replicas[0]) == 1,
                10,
            )
            result = await stream_one(client, stack.url, completion_body(5))
            assert (await holder).ok
        assert result.ok, result
        assert result.replica == stack.replicas[0]
        # The holder itself may also have drawn the dead endpoint first; every such pick was served
        # by the fallback, in a second attempt, and the client saw one clean response.
        dead_picks = stack.picker_value("picker_picks_total", endpoint=dead)
        assert dead_picks >= 1
        assert stack.picker_value("picker_fallback_served_total") == dead_picks
        await asyncio.to_thread(wait_until, lambda: len(stack.access_log.read_text().splitlines()) == 2, 10)
        attempts = [json.loads(line)["attempts"] for line in stack.access_log.read_text().splitlines()]
        assert sorted(attempts) == sorted([2] * int(dead_picks) + [1] * (2 - int(dead_picks)))
        stack.wait_no_leaks()
    finally:
        stack.stop()


async def test_forged_destination_header_neither_steers_nor_reaches(tmp_path: Path) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=3))
    outsider = stack.replicas[2]  # in Envoy's cluster, but not in the picker's pool
    stack.options.picker_endpoints = stack.replicas[:2]
    stack.start()
    try:
        forged = {"x-gateway-destination-endpoint": outsider, "x-picker-request-id": "forged"}
        async with http_client.AsyncClient(timeout=10) as client:
            results = [await stream_one(client, stack.url, completion_body(2), forged) for _ in range(10)]
            outsider_log = (await client.get(f"http://{outsider}/sim/requests")).json()
        assert all(r.ok for r in results)
        assert {r.replica for r in results} <= set(stack.replicas[:2])
        assert outsider_log["requests"] == [] if isinstance(outsider_log, dict) else outsider_log == []
        stack.wait_no_leaks()
    finally:
        stack.stop()


@pytest.mark.parametrize("fail_open", [False, True], ids=["failClose", "failOpen"])
async def test_picker_down_follows_the_failure_mode(tmp_path: Path, fail_open: bool) -> None:
    stack = Stack(tmp_path, StackOptions(replicas=2, failure_mode_allow=fail_open)).start()
    try:
        assert stack.picker is not None
        stack.picker.kill()
        async with http_client.AsyncClient(timeout=10) as client:
            result = await stream_one(client, stack.url, completion_body(3))
        if fail_open:
            assert result.ok and result.replica in stack.replicas
        else:
            assert result.status == 503 and not result.replica
    finally:
        stack.stop()


@pytest.mark.parametrize("fail_open", [False, True])
def test_shipped_envoy_config_validates(tmp_path: Path, fail_open: bool) -> None:
    config = tmp_path / "envoy.yaml"
    config.write_text(
        render(
            EnvoyParams(
                listen_port=10000,
                admin_port=9901,
                picker_port=9002,
                endpoints=["127.0.0.1:8000", "[::1]:8001"],
                failure_mode_allow=fail_open,
            )
        )
    )
    run = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "OK" in run.stdout + run.stderr
