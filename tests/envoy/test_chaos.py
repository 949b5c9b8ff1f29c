"""Chaos through the real Envoy (issue 40, item 7 of what to build): two pickers with one set of books
over an authenticated peer channel (each reached through a TCP relay the test controls), a canary
(three v1 replicas, one v2 candidate at 25 %) and prefix affinity, under a closed loop of streams with
shared prompt prefixes. In turn: cut the peer link for 5 s and restore it, SIGKILL a picker, drain a
replica, roll the canary back, restart the killed picker.

Goals: no stream cut (a new request refused by a picker that had just died is the contract's
retryable 503, and the client retries it), nothing picked onto a replica after its drain began or onto
the candidate after the rollback, each live picker's books equal to what the replicas run within 2 s
of each fault ending, and nothing left behind once the load stops (no request record, no entry in
any per-peer table).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import Result, stream_one
from picker.peers.outbox import SYNC_EVERY_S
from tests.envoy.test_picker_ha import until_healthy

pytestmark = pytest.mark.envoy

LABEL = "app.kubernetes.io/version"
WORKERS = 16
TOKENS = 40  # 25 ms apart: 1 s per stream
MAX_REQUESTS = 2000
DEADLINE_S = 90.0  # the load stops by itself by then, whatever happens
BOOKS_WITHIN_S = 2.0
IN_TRANSIT_S = 0.5  # a request picked just before a drain reaches its replica within this (loopback)
PREFIXES = [f"system prompt {n}: " + "be helpful and precise. " * 30 for n in range(4)]


@dataclass
class Load:
    """The closed loop's outcome: each request's last attempt, and how many contract 503s it retried."""

    results: list[Result] = field(default_factory=list)
    retried: list[Result] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)


async def closed_loop(url: str, load: Load) -> None:
    rng = random.Random(40)
    limits = httpx.Limits(max_connections=WORKERS + 4, max_keepalive_connections=WORKERS + 4)
    stop_at = time.monotonic() + DEADLINE_S
    async with http_client.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0, connect=5.0)) as client:

        async def worker() -> None:
            while not load.stop.is_set() and len(load.results) < MAX_REQUESTS and time.monotonic() < stop_at:
                body = {
                    "model": "tiny-llama",
                    "prompt": rng.choice(PREFIXES) + f"question {rng.randrange(10**6)}",
                    "max_tokens": TOKENS,
                    "ignore_eos": True,
                    "stream": True,
                }
                for _ in range(3):  # the contract's retryable refusal is retried, as a client does:
                    result = await stream_one(client, url, body)  # after its Retry-After
                    if result.status == 503 and result.retry_after:
                        load.retried.append(result)
                        await asyncio.sleep(min(float(result.retry_after), 2.0))  # the client's backoff
                        continue
                    break
                load.results.append(result)

        await asyncio.gather(*(worker() for _ in range(WORKERS)))


def status_of(stack: Stack, index: int) -> dict[str, Any]:
    port = stack.picker_ports[index][2]
    return http_client.get(f"http://127.0.0.1:{port}/admin/status", timeout=5).json()  # type: ignore[no-any-return]


def engine_counts(stack: Stack) -> dict[str, float]:
    out = {}
    for replica in stack.replicas:
        samples = parse_metrics(http_client.get(f"http://{replica}/metrics", timeout=5).text)
        out[replica] = sum(
            v
            for (n, _), v in samples.items()
            if n in ("vllm:num_requests_running", "vllm:num_requests_waiting")
        )
    return out


def books_gaps(stack: Stack, live: list[int]) -> dict[str, float]:
    """Per live picker and replica: what the picker counts there (its own and its peers') less what
    the replica runs; only the non-zero ones."""
    pickers = {index: status_of(stack, index) for index in live}
    engine = engine_counts(stack)
    gaps = {}
    for index, status in pickers.items():
        for lane in status["lanes"]:
            if lane["address"] in engine:
                gap = lane["in_flight"] + lane["peer_in_flight"] - engine[lane["address"]]
                if gap:
                    gaps[f"picker-{index} {lane['address']}"] = gap
    return gaps


async def books_settle(stack: Stack, live: list[int], after: str, figures: dict[str, Any]) -> None:
    """The books equal what the replicas run within BOOKS_WITHIN_S of a fault ending (polled)."""
    started = time.monotonic()
    last: dict[str, float] = {}
    while time.monotonic() - started < BOOKS_WITHIN_S:
        last = await asyncio.to_thread(books_gaps, stack, live)
        if not last:
            figures[f"books_equal_after_{after}_s"] = round(time.monotonic() - started, 2)
            return
        await asyncio.sleep(0.05)  # polling a figure across processes
    detail = await asyncio.to_thread(lambda: {i: status_of(stack, i)["peers"]["held"] for i in live})
    lanes = await asyncio.to_thread(
        lambda: {
            i: [(x["address"], x["in_flight"], x["peer_in_flight"]) for x in status_of(stack, i)["lanes"]]
            for i in live
        }
    )
    pytest.fail(
        f"books still differ {BOOKS_WITHIN_S} s after {after}: {last}; held {detail}; lanes {lanes}; "
        f"engines {engine_counts(stack)}; {json.dumps(figures)}"
    )


async def post(stack: Stack, index: int, path: str) -> dict[str, Any]:
    port = stack.picker_ports[index][2]
    async with http_client.AsyncClient(timeout=10) as client:
        response = await client.post(f"http://127.0.0.1:{port}{path}")
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def arrivals_after(stack: Stack, replica: str, wall: float) -> list[dict[str, Any]]:
    return [r for r in stack.sim_requests(replica) if r["arrival"] > wall + IN_TRANSIT_S]


def empty(status: dict[str, Any]) -> bool:
    """No request in flight on any lane, no entry in any per-peer table."""
    tables = status["peers"]["held"]
    lanes = status["lanes"]
    return (
        all(lane["in_flight"] == lane["peer_in_flight"] == 0 for lane in lanes)
        and tables["shadows"] == tables["orphans"] == tables["outbox"] == tables["connections"] == 0
        and all(n == 0 for n in tables["books"].values())
    )


def make_stack(tmp_path: Path) -> Stack:
    endpoints, config = tmp_path / "endpoints.yaml", tmp_path / "picker.yaml"
    rollout = {
        "group_label": LABEL,
        "stable": "v1",
        "candidate": "v2",
        "steps": [25, 50, 100],
        "step_interval_s": 600,  # it stays at 25 % until the test rolls it back
        "min_samples": 100000,
        "tick_s": 0.1,
    }
    pool = {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}
    config.write_text(json.dumps({"pool": pool, "rollout": rollout}))
    options = StackOptions(
        replicas=4,
        static_endpoints=False,
        picker_args=("--config", str(config)),
        pickers=2,
        peers=True,
        peer_relays=True,
        envoy_picker_tls=False,
    )
    stack = Stack(tmp_path, options)
    listed = [
        {"address": a, "labels": {LABEL: "v2" if i == 3 else "v1"}} for i, a in enumerate(stack.replicas)
    ]
    endpoints.write_text(json.dumps(listed))
    return stack


async def test_faults_in_turn_cut_nothing_misroute_nothing_and_leave_nothing(tmp_path: Path) -> None:
    stack = make_stack(tmp_path)
    candidate, drained = stack.replicas[3], stack.replicas[1]
    figures: dict[str, Any] = {}
    load = Load()
    try:
        await asyncio.to_thread(stack.start)
        for grpc_port, _, _ in stack.picker_ports:
            await until_healthy(stack, grpc_port, True)
        traffic = asyncio.create_task(closed_loop(stack.url, load))
        await asyncio.to_thread(wait_until, lambda: len(load.results) >= 30, 20, 0.05, "traffic flowing")
        await books_settle(stack, [0, 1], "start", figures)

        # 1. the peer link, cut for 5 s both ways, then restored
        for relay in stack.relays:
            relay.cut()
        await asyncio.sleep(5.0)  # the partition's length (the fault itself, not a synchronisation)
        for relay in stack.relays:
            relay.restore()
        await asyncio.to_thread(
            wait_until,
            lambda: all(not status_of(stack, i)["peers"]["unlinked"] for i in (0, 1)),
            5,
            0.05,
            "the pickers linked again",
        )
        await books_settle(stack, [0, 1], "peer-link-restored", figures)

        # 2. one picker SIGKILLed: Envoy's health check takes it out, the survivor counts its streams
        victim = stack.pickers[1]
        assert victim is not None
        victim.kill()
        await until_healthy(stack, stack.picker_ports[1][0], False)
        await books_settle(stack, [0], "picker-killed", figures)

        # 3. a replica drained through the survivor's admin API (the endpoints file: every picker)
        await post(stack, 0, f"/admin/endpoints/{drained}/drain")
        drain_wall = time.time()
        await asyncio.to_thread(
            wait_until,
            lambda: all(
                lane["in_flight"] + lane["peer_in_flight"] == 0
                for lane in status_of(stack, 0)["lanes"]
                if lane["address"] == drained
            ),
            15,
            0.05,
            "the drained replica's streams to end",
        )
        await books_settle(stack, [0], "drain", figures)

        # 4. the canary rolled back: weight 0, the candidate drained
        rollback = (await post(stack, 0, "/admin/rollout/abort"))["rollout"]
        assert rollback["phase"] == "rolled-back" and rollback["weight"] == 0, rollback
        rollback_wall = time.time()
        await books_settle(stack, [0], "rollback", figures)

        # 5. the killed picker restarted: linked to its peer, healthy in Envoy, both books exact
        await asyncio.to_thread(stack.start_picker_at, 1)
        await until_healthy(stack, stack.picker_ports[1][0], True, within=20)
        await books_settle(stack, [0, 1], "picker-restarted", figures)
        await asyncio.to_thread(
            wait_until, lambda: len(load.results) >= 40, 5, 0.05, "traffic after the restart"
        )

        load.stop.set()
        await asyncio.wait_for(traffic, 60)
        late_on_drained = await asyncio.to_thread(arrivals_after, stack, drained, drain_wall)
        late_on_candidate = await asyncio.to_thread(arrivals_after, stack, candidate, rollback_wall)
        # nothing left behind: at once, or at the latest after the owners' next sync of their books
        # (a book entry whose end was lost is put right by it; SYNC_EVERY_S)
        emptied = time.monotonic()
        seen: list[dict[str, Any]] = []

        def all_empty() -> bool:
            # the statuses judged are the ones reported: a later read may catch a message on its
            # way out to the other picker (a loaded run read an outbox of 3 just after all were 0)
            seen[:] = [status_of(stack, i) for i in (0, 1)]
            return all(empty(status) for status in seen)

        await asyncio.to_thread(wait_until, all_empty, SYNC_EVERY_S + 3.0, 0.1, "every per-peer table empty")
        figures["tables_empty_after_s"] = round(time.monotonic() - emptied, 2)
        statuses = list(seen)
        pool_drains = http_client.get(
            f"http://127.0.0.1:{stack.metrics_port}/admin/drains?scope=pool", timeout=5
        ).json()["drains"]
        in_flight = [stack.picker_value("picker_in_flight")]
    finally:
        load.stop.set()
        await asyncio.to_thread(stack.stop)

    cut = [r for r in load.results if r.status == 200 and not r.ok]
    failed = [r for r in load.results if r.status != 200]
    by_replica: dict[str, int] = {}
    for result in load.results:
        by_replica[result.replica] = by_replica.get(result.replica, 0) + 1
    held = [s["peers"]["held"] for s in statuses]
    lanes = [
        (lane["address"], lane["in_flight"], lane["peer_in_flight"]) for s in statuses for lane in s["lanes"]
    ]
    figures.update(
        {
            "requests": len(load.results),
            "retried_503": len(load.retried),
            "retried_reasons": sorted({r.reason_header for r in load.retried}),
            "streams_cut": len(cut),
            "failed": len(failed),
            "by_replica": by_replica,
            "late_on_drained": len(late_on_drained),
            "late_on_candidate": len(late_on_candidate),
            "held_after": held,
        }
    )
    print("chaos:", json.dumps(figures))
    assert not cut and not failed, figures
    assert all(r.reason_header == "picker-unavailable" for r in load.retried), figures
    assert late_on_drained == [] and late_on_candidate == [], figures
    drain_record = next(d for d in pool_drains if d["address"] == drained)
    assert drain_record["picks_after_start"] == 0, drain_record
    assert in_flight == [0.0], figures
    for tables in held:  # nothing kept for anyone once nothing runs
        assert tables["shadows"] == tables["orphans"] == tables["outbox"] == tables["connections"] == 0, held
        assert all(n == 0 for n in tables["books"].values()), held
    assert all(own == peers == 0 for _, own, peers in lanes), lanes
    assert by_replica.get(candidate, 0) > 0  # the canary had its share before the rollback
