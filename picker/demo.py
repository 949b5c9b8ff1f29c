"""`picker demo`: the whole path on this machine, with live traffic, explained as it happens."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Report, percentile, run_closed_loop

_SIM_ARGS = ("--ttft-ms", "40", "--itl-ms", "15", "--itl-jitter-ms", "3")


def _print_report(report: Report, replicas: list[str]) -> None:
    ttfts = report.ttfts()
    counts = report.by_replica()
    print(f"\n{len(report.results)} streaming requests in {report.wall_s:.1f} s")
    print("  requests per replica:")
    for replica in replicas:
        print(f"    {replica:<22} {counts.get(replica, 0):>5}")
    print(
        f"  time to first token: p50 {percentile(ttfts, 50) * 1000:.1f} ms, "
        f"p99 {percentile(ttfts, 99) * 1000:.1f} ms"
    )
    failures = report.failures()
    print(f"  failed or incomplete streams: {len(failures)}")
    for failure in failures[:5]:
        print(f"    status={failure.status} error={failure.error or '-'} done={failure.done}")


async def run_demo(seconds: float = 8.0) -> int:
    """Start 3 simulated replicas, the picker and Envoy; stream through Envoy; report; stop all."""
    with tempfile.TemporaryDirectory(prefix="picker-demo-") as tmp:
        workdir = Path(tmp)
        stack = Stack(workdir, StackOptions(replicas=3, sim_args=_SIM_ARGS))
        print("starting 3 simulated vLLM replicas, the picker and Envoy (all on 127.0.0.1) ...")
        await asyncio.to_thread(stack.start)
        try:
            print(f"  Envoy listener  {stack.url}")
            print(
                f"  picker          ext_proc :{stack.grpc_port}, metrics http://127.0.0.1:{stack.metrics_port}"
                "/metrics"
            )
            print(f"  replicas        {', '.join(stack.replicas)}")
            print(f"sending streaming completions through Envoy for {seconds:.0f} s (12 at a time) ...")
            report = await run_closed_loop(
                stack.url, concurrency=12, max_requests=100_000, deadline_s=seconds, max_tokens=40
            )
            _print_report(report, stack.replicas)
            in_flight = await asyncio.to_thread(stack.picker_value, "picker_in_flight")
            print(f"  picker in-flight after the run: {in_flight:.0f}")
            return 0 if not report.failures() else 1
        finally:
            await asyncio.to_thread(stack.stop)
