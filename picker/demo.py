"""`picker demo`: the whole path on this machine, with live traffic, explained as it happens.

Three simulated vLLM replicas, the picker and Envoy; streaming completions through Envoy; one replica
drained mid-traffic through the endpoints file (as Kubernetes marks a terminating pod, then removes
it), and the drain record the picker kept about it.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Report, percentile, run_closed_loop

_SIM_ARGS = ("--ttft-ms", "40", "--itl-ms", "15", "--itl-jitter-ms", "3")


def _print_report(report: Report, replicas: list[str], drained: str) -> None:
    ttfts = report.ttfts()
    counts = report.by_replica()
    print(f"\n{len(report.results)} streaming requests in {report.wall_s:.1f} s")
    print("  requests per replica:")
    for replica in replicas:
        note = "  (drained part-way through)" if replica == drained else ""
        print(f"    {replica:<22} {counts.get(replica, 0):>5}{note}")
    print(
        f"  time to first token: p50 {percentile(ttfts, 50) * 1000:.1f} ms, "
        f"p99 {percentile(ttfts, 99) * 1000:.1f} ms"
    )
    failures = report.failures()
    print(f"  failed or incomplete streams: {len(failures)}")
    for failure in failures[:5]:
        print(f"    status={failure.status} error={failure.error or '-'} done={failure.done}")


def _print_record(record: dict[str, Any]) -> None:
    ended = ", ".join(f"{kind.replace('-', ' ')} {count}" for kind, count in record["ended"].items())
    print("\ndrain record (from GET /admin/endpoints on the picker's metrics port):")
    rows = [
        ("endpoint", record["address"]),
        ("why", f"its source ({record['source']}) said draining"),
        ("in flight at drain start", record["in_flight_at_start"]),
        ("how they ended", ended),
        ("new picks after start", f"{record['picks_after_start']}   (must stay 0)"),
        ("time to zero in flight", f"{record['time_to_zero_s']:.2f} s"),
        ("exit", f"{record['exit']} ({record['duration_s']:.2f} s after the drain began)"),
    ]
    for label, value in rows:
        print(f"  {label:<26}{value}")


def _write_endpoints(path: Path, entries: list[dict[str, Any]]) -> None:
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(entries, indent=1))  # JSON is YAML
    os.replace(temp, path)  # atomic: the picker never reads a half-written file


class _FileDrain:
    """Drains one replica through the endpoints file while traffic runs, narrating each step."""

    def __init__(self, stack: Stack, path: Path, started: float) -> None:
        self._stack = stack
        self._path = path
        self._started = started
        self._admin = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints"
        self.record: dict[str, Any] | None = None

    def say(self, text: str) -> None:
        print(f"  t={time.monotonic() - self._started:4.1f}s  {text}")

    async def _until(
        self, client: httpx.AsyncClient, test: Callable[[dict[str, Any]], bool]
    ) -> dict[str, Any]:
        deadline = time.monotonic() + 20
        while True:
            view = (await client.get(self._admin)).json()
            if test(view):
                return view
            if time.monotonic() > deadline:
                raise TimeoutError("the picker did not get there in 20 s")
            await asyncio.sleep(0.02)

    async def run(self, after_s: float) -> None:
        replicas, drained = self._stack.replicas, self._stack.replicas[-1]
        await asyncio.sleep(after_s)

        def mine(view: dict[str, Any]) -> dict[str, Any]:
            return next((e for e in view["endpoints"] if e["address"] == drained), {})

        async with httpx.AsyncClient(timeout=5) as client:
            self.say(f"marking {drained} as draining in the endpoints file")
            self.say("(what Kubernetes does when that replica's pod starts terminating)")
            _write_endpoints(self._path, [{"address": a, "draining": a == drained} for a in replicas])
            view = await self._until(client, lambda v: mine(v).get("state") == "draining")
            in_flight = mine(view)["in_flight"]
            self.say(f"picker: {drained} is DRAINING with {in_flight} streams in flight there;")
            self.say("        new requests now go only to the other two replicas")
            view = await self._until(client, lambda v: mine(v).get("in_flight") == 0)
            to_zero = mine(view)["drain"]["time_to_zero_s"]
            self.say(f"picker: its last stream finished {to_zero:.2f} s after the drain began, none cut")
            self.say("removing it from the file (the pod is gone)")
            _write_endpoints(self._path, [{"address": a} for a in replicas if a != drained])
            view = await self._until(
                client, lambda v: any(r["address"] == drained for r in v["recent_drains"])
            )
            self.record = next(r for r in view["recent_drains"] if r["address"] == drained)
            self.say("picker: endpoint gone, drain record closed")


async def run_demo(seconds: float = 8.0) -> int:
    """Start 3 simulated replicas, the picker and Envoy; stream through Envoy; drain one; report; stop all."""
    with tempfile.TemporaryDirectory(prefix="picker-demo-") as tmp:
        workdir = Path(tmp)
        endpoints_file = workdir / "endpoints.yaml"
        config = workdir / "picker.yaml"
        config.write_text(
            json.dumps({"pool": {"endpoints_file": str(endpoints_file), "endpoints_file_poll_s": 0.1}})
        )
        options = StackOptions(
            replicas=3, sim_args=_SIM_ARGS, static_endpoints=False, picker_args=("--config", str(config))
        )
        stack = Stack(workdir, options)
        _write_endpoints(endpoints_file, [{"address": a} for a in stack.replicas])
        print("starting 3 simulated vLLM replicas, the picker and Envoy (all on 127.0.0.1) ...")
        await asyncio.to_thread(stack.start)
        try:
            print(f"  Envoy listener  {stack.url}")
            print(
                f"  picker          ext_proc :{stack.grpc_port}, metrics http://127.0.0.1:{stack.metrics_port}"
                "/metrics"
            )
            print(f"  replicas        {', '.join(stack.replicas)}")
            print(f"  endpoints file  {endpoints_file} (the picker re-reads it when it changes)")
            print(f"sending streaming completions through Envoy for {seconds:.0f} s (12 at a time) ...")
            drain = _FileDrain(stack, endpoints_file, time.monotonic())
            report, _ = await asyncio.gather(
                run_closed_loop(
                    stack.url, concurrency=12, max_requests=100_000, deadline_s=seconds, max_tokens=40
                ),
                drain.run(after_s=seconds * 0.3),
            )
            _print_report(report, stack.replicas, stack.replicas[-1])
            in_flight = await asyncio.to_thread(stack.picker_value, "picker_in_flight")
            print(f"  picker in-flight after the run: {in_flight:.0f}")
            if drain.record is not None:
                _print_record(drain.record)
            log_lines = stack.picker.log_text().splitlines() if stack.picker is not None else []
            closed = [line[line.index("drain closed") :] for line in log_lines if "drain closed" in line]
            if closed:
                print("\nthe picker's log line for it:")
                print(f"  {closed[-1]}")
            clean = drain.record is not None and drain.record["picks_after_start"] == 0
            return 0 if clean and not report.failures() else 1
        finally:
            await asyncio.to_thread(stack.stop)
