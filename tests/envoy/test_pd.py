"""Prefill / decode pools through the real Envoy: the picker sends each request to a decode replica and
names the prefill replica in `x-prefiller-host-port`, which reaches the destination unchanged in every
gateway shape (the routing sidecar in front of each decode replica, played by the simulator's
`--pd-sidecar`, prefills there first, then decodes with the KV it pulls); a client's own header never
does; a prefill-only replica is never a destination; a draining prefill replica's drain waits for
the KV still to be pulled from it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one
from picker.cli.envoyconf import SHIPPED

pytestmark = pytest.mark.envoy

# prefill x2, decode x2; the decode replicas play llm-d's routing sidecar
ROLES = ("prefill", "prefill", "decode", "decode")
LONG = "Summarise the report below in three paragraphs, citing each table. " * 40  # ~700 tokens
SHAPE_IDS = [SHIPPED, "eg-buffered", "aigw-failopen", "aigw-failclose", "kgateway"]


def write_pool(path: Path, replicas: list[str], draining: str | None = None) -> None:
    roles = zip(replicas, ROLES, strict=True)
    entries = [{"address": a, "role": role, "draining": a == draining} for a, role in roles]
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(entries))
    temp.replace(path)


def pd_stack(workdir: Path, shape: str = SHIPPED, transfer_ms: int = 5) -> tuple[Stack, Path]:
    endpoints = workdir / "endpoints.yaml"
    config = workdir / "picker.yaml"
    config.write_text(json.dumps({"pool": {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}}))
    decode = ("--role", "decode", "--pd-sidecar")
    options = StackOptions(
        replicas=len(ROLES),
        sim_args=("--ttft-ms", "20", "--itl-ms", "10", "--kv-transfer-ms", str(transfer_ms)),
        picker_args=("--config", str(config)),
        static_endpoints=False,
        shape=shape,
        envoy_picker_tls=shape == SHIPPED,
        replica_args=(("--role", "prefill"), ("--role", "prefill"), decode, decode),
    )
    stack = Stack(workdir, options)
    write_pool(endpoints, stack.replicas)
    return stack.start(), endpoints


def requests_on(replica: str) -> list[dict[str, Any]]:
    answer = http_client.get(f"http://{replica}/sim/requests", timeout=5).json()
    return list(answer["requests"] if isinstance(answer, dict) else answer)


def endpoints_view(stack: Stack) -> dict[str, dict[str, Any]]:
    view = http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()
    return {e["address"]: e for e in view["endpoints"]}


@pytest.fixture(scope="module", params=SHAPE_IDS)
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack, _ = pd_stack(tmp_path_factory.mktemp(f"pd-{request.param}"), request.param)
    try:
        yield stack
    finally:
        stack.stop()


async def test_the_prefill_replica_named_by_the_picker_reaches_the_decode_replica(shaped: Stack) -> None:
    stack = shaped
    prefills, decodes = stack.replicas[:2], stack.replicas[2:]
    for replica in stack.replicas:
        http_client.delete(f"http://{replica}/sim/requests", timeout=5)
    async with http_client.AsyncClient(timeout=30) as client:
        bodies = [{**completion_body(8), "prompt": f"{i} {LONG}"} for i in range(6)]
        # a client's own header names a replica of its choosing: it never reaches a decode replica
        forged = {"x-prefiller-host-port": "127.0.0.1:9"}
        results = await asyncio.gather(*(stream_one(client, stack.url, b, headers=forged) for b in bodies))
    assert all(r.status == 200 and r.done for r in results), results
    assert {r.replica for r in results} <= set(decodes)  # a prefill-only replica is never a destination
    decoded = [r for d in decodes for r in requests_on(d)]
    assert len(decoded) == 6 and all(r["prefiller"] in prefills for r in decoded), decoded
    steps = [r for p in prefills for r in requests_on(p)]
    # one prefill step per request, each on the replica its decode was told of, asking for a remote decode
    assert len(steps) == 6 and all(r["remote_decode"] for r in steps), steps
    named = sorted(r["prefiller"] for r in decoded)
    assert sorted(p for p in prefills for r in requests_on(p)) == named
    view = endpoints_view(stack)
    assert [view[a]["role"] for a in stack.replicas] == list(ROLES)
    await asyncio.to_thread(
        wait_until, lambda: all(e["kv_pulls_pending"] == 0 for e in endpoints_view(stack).values()), 5
    )
    assert stack.picker_value("picker_pd_picks_total", how="pair") >= 6


async def test_a_short_prompt_is_decoded_where_it_lands_without_a_prefill_hop(shaped: Stack) -> None:
    stack = shaped
    for replica in stack.replicas:
        http_client.delete(f"http://{replica}/sim/requests", timeout=5)
    async with http_client.AsyncClient(timeout=30) as client:
        result = await stream_one(
            client, stack.url, completion_body(4), headers={"x-prefiller-host-port": "127.0.0.1:9"}
        )
    assert result.status == 200 and result.done and result.replica in stack.replicas[2:], result
    decoded = requests_on(result.replica)
    assert len(decoded) == 1 and decoded[0]["prefiller"] is None, decoded  # the client's header removed
    assert not any(requests_on(p) for p in stack.replicas[:2])


async def test_a_draining_prefill_replica_waits_for_the_kv_still_to_be_pulled(tmp_path: Path) -> None:
    """Pulls take 1.5 s here: the drain of the prefill replica starts while they are pending, its
    record counts them, and it reaches zero only once each decode replica has pulled its KV."""
    stack, endpoints = pd_stack(tmp_path, transfer_ms=1500)
    try:
        prefill = stack.replicas[0]
        write_pool(endpoints, stack.replicas, draining=stack.replicas[1])  # every prefill on replica 0
        await asyncio.to_thread(
            wait_until, lambda: endpoints_view(stack)[stack.replicas[1]]["state"] == "draining", 5
        )
        async with http_client.AsyncClient(timeout=30) as client:
            bodies = [{**completion_body(4), "prompt": f"{i} {LONG}"} for i in range(3)]
            streams = [asyncio.create_task(stream_one(client, stack.url, b)) for b in bodies]
            await asyncio.to_thread(
                wait_until, lambda: endpoints_view(stack)[prefill]["kv_pulls_pending"] == 3, 10
            )
            write_pool(endpoints, stack.replicas, draining=prefill)
            await asyncio.to_thread(
                wait_until, lambda: endpoints_view(stack)[prefill]["drain"] is not None, 5
            )
            drain = endpoints_view(stack)[prefill]["drain"]
            assert drain["pulls_at_start"] == 3 and drain["time_to_zero_s"] is None, drain
            results = await asyncio.gather(*streams)
        assert all(r.status == 200 and r.done for r in results), results
        await asyncio.to_thread(
            wait_until, lambda: endpoints_view(stack)[prefill]["drain"]["time_to_zero_s"] is not None, 5
        )
        drain = endpoints_view(stack)[prefill]["drain"]
        assert drain["ended"]["kv-pulled"] == 3 and drain["picks_after_start"] == 0, drain
        assert drain["time_to_zero_s"] >= 1.0, drain  # it waited for the pulls, which took 1.5 s each
    finally:
        stack.stop()
