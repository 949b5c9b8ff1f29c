"""The autoscaling signals on a running picker's /metrics (issue 55, item 2): two replicas of 2 slots
under 3 streams that hold their slots (the simulator's stall fault). The per-pool gauges follow the
load as it comes and goes, and the replicas a scale-down could take read 0 exactly when the capacity
guard refuses a drain: the scale-down that would starve the pool is visible before it happens.

Through `picker proxy` alone: the figures are the core's, read when the page is; the frontend only
carries the streams."""

from __future__ import annotations

import asyncio
from pathlib import Path

from loadtest import http_client
from loadtest.procs import wait_until
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions

POOL = "pool-a"
SIM = ("--model", "m", "--ttft-ms", "5", "--itl-ms", "10", "--max-num-seqs", "2")
HELD = 3  # streams that keep their slot until the client leaves: 3 of 4 slots


def gauges(stack: ProxyStack) -> dict[str, float]:
    """The pool's samples on the page, by family (absent: not on the page)."""
    return {
        name: value
        for (name, labels), value in stack.picker_metrics().items()
        if dict(labels) == {"pool": POOL}
    }


async def hold(url: str, opened: asyncio.Queue[int], leave: asyncio.Event) -> None:
    """One stream that takes its first token, then holds its slot until told to leave."""
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
    async with (
        http_client.AsyncClient(timeout=30) as client,
        client.stream(
            "POST", f"{url}/v1/completions", json=body, headers={"x-sim-fault": "stall-after=1"}
        ) as response,
    ):
        assert response.status_code == 200
        chunks = response.aiter_bytes()  # held: a finished iterator would close the stream
        await anext(chunks)
        await opened.put(1)
        await leave.wait()


async def test_the_pool_gauges_follow_the_load_and_show_the_guards_answer(tmp_path: Path) -> None:
    options = StackOptions(
        replicas=2,
        sim_args=SIM,
        picker_args=("--engine-slots", "2"),
        picker_env={"PICKER_AUTOSCALING__POOL_LABEL": POOL},
    )
    stack = ProxyStack(tmp_path, options).start()
    try:
        admin = f"http://127.0.0.1:{stack.metrics_port}"
        idle = gauges(stack)
        assert idle["picker_pool_ready_capacity"] == 4 and idle["picker_pool_demand"] == 0
        assert idle["picker_pool_saturation"] == 0 and idle["picker_pool_predicted_wait_seconds"] == 0
        assert idle["picker_pool_removable_replicas"] == 1  # idle: one of the two may go
        assert idle["picker_flow_queue_size"] == 0

        opened: asyncio.Queue[int] = asyncio.Queue()
        leave = asyncio.Event()
        streams = [asyncio.create_task(hold(stack.url, opened, leave)) for _ in range(HELD)]
        for _ in range(HELD):
            await asyncio.wait_for(opened.get(), 20)
        busy = gauges(stack)  # each stream was booked at its pick, before its first byte
        assert busy["picker_pool_demand"] == HELD and busy["picker_pool_saturation"] == HELD / 4
        assert busy["picker_pool_predicted_wait_seconds"] == 0  # a slot is free
        # 3 x 1.1 needs more than the 2 slots one replica has: no replica may go, and the guard says so
        assert busy["picker_pool_removable_replicas"] == 0
        # the replica with 2 of the 3 streams drains: the ready one keeps a free slot
        first = max(stack.replicas, key=lambda r: stack.picker_value("picker_endpoint_in_flight", endpoint=r))
        assert stack.picker_value("picker_endpoint_in_flight", endpoint=first) == 2
        async with http_client.AsyncClient(timeout=10) as client:
            refused = await client.post(f"{admin}/admin/endpoints/{first}/drain")
            assert refused.status_code == 409, refused.text
            forced = await client.post(f"{admin}/admin/endpoints/{first}/drain?force=true")
            assert forced.status_code == 200, forced.text
            drained = gauges(stack)
            assert drained["picker_pool_ready_capacity"] == 2  # the draining replica's slots are gone
            assert drained["picker_pool_demand"] == HELD  # its streams are still demand
            assert drained["picker_pool_saturation"] == HELD / 2
            # the draining replica's streams are not ahead of a newcomer: it gets the free ready slot
            assert drained["picker_pool_predicted_wait_seconds"] == 0
            leave.set()
            await asyncio.wait_for(asyncio.gather(*streams), 20)
            await asyncio.to_thread(stack.wait_no_leaks)
            await client.post(f"{admin}/admin/endpoints/{first}/undrain")
        await asyncio.to_thread(
            wait_until,
            lambda: gauges(stack).get("picker_pool_removable_replicas") == 1,
            10,
            what="the pool idle and whole again",
        )
        after = gauges(stack)
        assert after["picker_pool_demand"] == 0 and after["picker_pool_ready_capacity"] == 4
    finally:
        stack.stop()
