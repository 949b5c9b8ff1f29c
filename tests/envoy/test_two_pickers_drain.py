"""A drain through two active pickers with one set of books (issue 23, item 4): the pool's drain record
(`/admin/drains?scope=pool`, and `picker scorecard`, asked of either picker) counts every stream that
was on the replica when the drain began, whichever picker routed it and wherever its end was seen,
and agrees with the replica's own request log. The endpoints file is the shared source."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from loadtest import http_client
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import run_closed_loop
from picker.drain import scorecard
from tests.envoy.test_drain import IN_TRANSIT_S, SIM_ARGS, STREAM_TOKENS, FileSource, all_arrived, until

pytestmark = pytest.mark.envoy

CONCURRENCY = 48
TRAFFIC_S = 9.0


def pool_drains(metrics_port: int) -> list[dict[str, Any]]:
    return drains_of(metrics_port, scope="pool")


def drains_of(metrics_port: int, scope: str) -> list[dict[str, Any]]:
    """The picker's drain records: the pool's (`scope="pool"`) or its own (`scope=""`)."""
    url = f"http://127.0.0.1:{metrics_port}/admin/drains?scope={scope}"
    drains = http_client.get(url, timeout=5).json()["drains"]
    assert isinstance(drains, list)
    return drains


def in_flight_everywhere(stack: Stack, address: str) -> int:
    """The replica's streams as the pickers count them, each its own (their sum: every stream)."""
    total = 0
    for _, _, metrics_port in stack.picker_ports:
        view = http_client.get(f"http://127.0.0.1:{metrics_port}/admin/endpoints", timeout=5).json()
        total += sum(e["in_flight"] for e in view["endpoints"] if e["address"] == address)
    return total


async def test_the_pools_drain_record_is_every_stream_on_the_replica(tmp_path: Path) -> None:
    source = FileSource(tmp_path)
    options = StackOptions(
        replicas=3, sim_args=SIM_ARGS, static_endpoints=False, pickers=2, peers=True, envoy_picker_tls=False
    )
    stack = Stack(tmp_path, options)
    stack.options.picker_args = await source.setup(stack)
    drained = stack.replicas[0]
    try:
        await asyncio.to_thread(stack.start)
        traffic = asyncio.create_task(
            run_closed_loop(
                stack.url,
                concurrency=CONCURRENCY,
                max_requests=1000,
                deadline_s=TRAFFIC_S,
                max_tokens=STREAM_TOKENS,
            )
        )
        await until(lambda: in_flight_everywhere(stack, drained) >= 10, 15, "the replica to carry streams")
        await source.drain(stack, 0)
        # both: one alone is a pool record too, and the other may still pick the replica for a moment
        await until(
            lambda: [d["pickers"] for d in pool_drains(stack.metrics_port)] == [2],
            10,
            "both pickers to open it",
        )
        await until(lambda: all_arrived(stack, drained), 10, "the streams sent before the drain to arrive")
        async with http_client.AsyncClient(timeout=5) as client:
            await client.post(f"http://{drained}/sim/faults", json={"status": 500})  # as a draining vLLM
            await until(lambda: in_flight_everywhere(stack, drained) == 0, 15, "its streams to end")
            await client.delete(f"http://{drained}/sim/faults")
            await source.finish(stack, 0)
            await until(lambda: not pool_drains(stack.metrics_port)[0]["open"], 10, "the record to close")
            report = await traffic
            arrivals = (await client.get(f"http://{drained}/sim/requests")).json()
        other_port = stack.picker_ports[1][2]
        (record,) = pool_drains(other_port)  # asked of the other picker: the same, the pool's
        assert record == pool_drains(stack.metrics_port)[0]
        started_wall = float(record["started_wall"])
        on_replica = [
            r
            for r in arrivals
            if r["arrival"] <= started_wall + IN_TRANSIT_S and (r["end"] is None or r["end"] >= started_wall)
        ]
        print(
            "two pickers, pool drain record:",
            {k: record[k] for k in ("in_flight_at_start", "ended", "picks_after_start", "pickers")},
            "replica's log:",
            len(on_replica),
            "each picker's (started, in flight then):",
            [
                [(d["started_wall"], d["in_flight_at_start"]) for d in drains_of(port, scope="")]
                for _, _, port in stack.picker_ports
            ],
        )
        assert report.failures() == [], report.failures()[:3]
        assert record["pickers"] == 2 and record["exit"] == "gone"
        assert record["in_flight_at_start"] >= 10
        assert abs(len(on_replica) - record["in_flight_at_start"]) <= 1  # a stream ending at that very ms
        assert record["ended"].get("completed") == record["in_flight_at_start"]
        assert sum(record["ended"].values()) == record["in_flight_at_start"]
        assert record["picks_after_start"] == 0
        assert all(r["outcome"] == "completed" for r in arrivals)  # none got the draining 500
        rows = scorecard.score(scorecard.fetch(f"http://127.0.0.1:{other_port}"), grace_s=30.0)
        (row,) = [r for r in rows if r["endpoint"] == drained]
        assert row["in_flight_at_start"] == record["in_flight_at_start"] and row["forced_cuts"] == 0
        assert row["completed"] == row["in_flight_at_start"] and row["picks_after_start"] == 0
    finally:
        await asyncio.to_thread(stack.stop)
