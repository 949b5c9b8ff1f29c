"""Benchmark: the status page (`/status`) in headless Chromium against the picker of a demo-sized stack
(three simulated replicas, the picker, the real Envoy).

Prints, in one run: the page's first contentful paint (over `--loads` fresh loads), how long a state
change takes to show (an admin drain or undrain, to the lane's state in the DOM), and what an open
page costs the picker: its CPU over `--seconds` with no page open, then with one page open (no
traffic in either, so the difference is the page's polls), in interleaved rounds. Bounded: every
phase stops at its count or deadline.

    python -m loadtest.bench_status [--loads 5] [--changes 6] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

from loadtest import http_client
from loadtest.browser import Browser, chromium_binary
from loadtest.rawclient import cpu_seconds
from loadtest.stack import Stack, StackOptions


async def first_paints(stack: Stack, workdir: Path, loads: int) -> list[float]:
    out: list[float] = []
    url = f"http://127.0.0.1:{stack.metrics_port}/status"
    for _ in range(loads):
        async with Browser(workdir) as page:  # a fresh browser each time: nothing cached
            await page.goto(url)
            paint = await page.wait_for(
                "performance.getEntriesByName('first-contentful-paint')[0]?.startTime", 10, "a first paint"
            )
            await page.wait_for("document.querySelectorAll('.lane').length > 0", 10, "the lanes")
            out.append(float(paint))
    return out


async def update_delays(stack: Stack, workdir: Path, changes: int) -> list[float]:
    admin = f"http://127.0.0.1:{stack.metrics_port}"
    target = stack.replicas[0]
    state = f"(document.querySelector('.lane[data-address=\"{target}\"]')?.dataset.state ?? '')"
    out: list[float] = []
    async with Browser(workdir) as page, http_client.AsyncClient(timeout=10) as client:
        await page.goto(f"{admin}/status")
        await page.wait_for(f"{state} === 'ready'", 10, "the lane")
        for i in range(changes):
            verb, shown = ("drain", "draining") if i % 2 == 0 else ("undrain", "ready")
            started = time.perf_counter()
            (await client.post(f"{admin}/admin/endpoints/{target}/{verb}?force=true")).raise_for_status()
            await page.wait_for(f"{state} === '{shown}'", 10, f"the lane {shown}")
            out.append(time.perf_counter() - started)
    return out


async def picker_cpu(stack: Stack, workdir: Path, seconds: float, with_page: bool) -> float:
    """The picker's CPU share of one core over `seconds`, without traffic: what the page alone adds."""
    assert stack.picker is not None
    pid = stack.picker.pid

    async def measure() -> float:
        before, started = cpu_seconds(pid), time.perf_counter()
        await asyncio.sleep(seconds)  # the measuring window (the page polls meanwhile, or nothing does)
        return (cpu_seconds(pid) - before) / (time.perf_counter() - started)

    if not with_page:
        return await measure()
    async with Browser(workdir) as page:
        await page.goto(f"http://127.0.0.1:{stack.metrics_port}/status")
        await page.wait_for("document.querySelectorAll('.lane').length > 0", 10, "the lanes")
        return await measure()


async def main_async(args: argparse.Namespace, workdir: Path) -> None:
    stack = Stack(workdir, StackOptions(replicas=3, sim_args=("--ttft-ms", "20", "--itl-ms", "10"))).start()
    try:
        paints = await first_paints(stack, workdir, args.loads)
        delays = await update_delays(stack, workdir, args.changes)
        rounds = []
        for _ in range(args.rounds):  # interleaved: the machine's drift hits both alike
            idle = await picker_cpu(stack, workdir, args.seconds, with_page=False)
            open_page = await picker_cpu(stack, workdir, args.seconds, with_page=True)
            rounds.append((idle, open_page))
    finally:
        stack.stop()
    print(
        f"first contentful paint over {len(paints)} loads: median {statistics.median(paints):.0f} ms, "
        f"max {max(paints):.0f} ms (goal < 1,000 ms)"
    )
    print(
        f"a drain or undrain to the lane's state on the page, {len(delays)} changes: median "
        f"{1000 * statistics.median(delays):.0f} ms, max {1000 * max(delays):.0f} ms "
        "(goal < 1,000 ms; the page polls every 500 ms)"
    )
    print("| round | picker CPU, no page | with one page open | the page's share of a core |")
    print("|---|---|---|---|")
    for i, (idle, open_page) in enumerate(rounds, 1):
        print(f"| {i} | {100 * idle:.2f} % | {100 * open_page:.2f} % | {100 * (open_page - idle):+.2f} % |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loads", type=int, default=5)
    parser.add_argument("--changes", type=int, default=6)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if chromium_binary() is None:
        print("no Chromium installed (apt-get install chromium): nothing to measure")
        return 1
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
