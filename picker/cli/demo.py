"""`picker demo`: the whole path on this machine, with live traffic, explained as it happens.

Three simulated vLLM replicas, the picker and Envoy; streaming completions through Envoy; one replica
drained mid-traffic through the endpoints file (as Kubernetes marks a terminating pod, then removes
it), and the drain record the picker kept about it. The traffic (seeded Poisson arrivals, open loop)
and the drain's steps are kept on one clock and drawn as the rollout picture (loadtest/rollout/
timeline.py), a PNG whose path is printed; without matplotlib (a dev dependency) the demo says so and
draws nothing.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from loadtest.rollout.load import DROPPED_REASON_HEADER, LoadReport, poisson_arrivals, replay
from loadtest.rollout.timeline import Panel, TimelineEvent, draw, mark_event, state_event
from loadtest.stack import Stack, StackOptions
from loadtest.traffic import Report, Result, percentile

_SIM_ARGS = ("--ttft-ms", "40", "--itl-ms", "15", "--itl-jitter-ms", "3")
_RATE = 18.0  # arrivals per second: about what 12 streams of 40 tokens at 15 ms keep going
_TOKENS = (30, 50)
DEFAULT_PICTURE = Path(tempfile.gettempdir()) / "picker-demo-rollout.png"


def _as_report(load: LoadReport) -> Report:
    """The replayed outcomes in the shape the demo's printed summary reads (one classification)."""
    results = []
    for outcome in load.outcomes:
        r = outcome.result
        kind = outcome.kind
        results.append(
            Result(
                status=r.status or 0,
                replica=outcome.replica,
                ttft_s=r.ttft if kind == "completed" else None,
                duration_s=r.t_end,
                chunks=len(r.content_chunks),
                done=r.done,
                finish_reason=r.finish_reason,
                reason_header=r.headers.get(DROPPED_REASON_HEADER, ""),
                error="" if kind == "completed" else kind,
            )
        )
    return Report(results, load.wall_s)


def draw_rollout(
    path: Path, replicas: list[str], drained: str, load: LoadReport, drain_events: list[TimelineEvent]
) -> Path | None:
    """The rollout picture of this run at `path`; None (and says why) when matplotlib is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        print("\nno rollout picture: matplotlib is not installed (pip install -e '.[dev]')")
        return None
    events = [state_event(0.0, replica, "ready") for replica in replicas]
    events += drain_events + load.timeline_events()
    lanes = {r: f"{r}{' (drained)' if r == drained else ''}" for r in replicas}
    failed = sum(1 for o in load.outcomes if o.kind != "completed")
    note = f"{len(load.outcomes)} streams, {failed} failed; {drained} drained through the endpoints file"
    panel = Panel("Envoy + picker (picker demo)", events, note, lanes)
    caption = (
        "Each lane is a replica: its colour is its state in the picker, the line inside it the streams\n"
        "in flight there; dashed ticks: the endpoints file changed; markers: what a client saw go wrong."
    )
    return draw([panel], path, "picker demo: one replica drained under live traffic", caption)


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


def _arrivals_after(stack: Stack, since: float) -> dict[str, int]:
    """Requests each replica received after `since` (wall clock), from its own request log."""
    return {
        replica: sum(1 for r in stack.sim_requests(replica) if float(r["arrival"]) > since)  # type: ignore[arg-type]
        for replica in stack.replicas
    }


def print_drain_outcome(report: Report, drained: str, arrivals: dict[str, int] | None) -> None:
    """What the traffic and the replicas saw of the drain, counted, not assumed."""
    served = [r for r in report.results if r.replica == drained]
    cut = [r for r in served if not r.ok]
    print("\nthe drain, as measured (client results, then each replica's own request log):")
    print(f"  streams served by {drained}: {len(served)}, cut or failed: {len(cut)}")
    if arrivals is None:
        print("  the drain never began: no arrivals to compare")
        return
    print("  requests that reached each replica after the drain began:")
    for replica, count in arrivals.items():
        note = "  (the drained one)" if replica == drained else ""
        print(f"    {replica:<22} {count:>5}{note}")
    receivers = [replica for replica, count in arrivals.items() if count and replica != drained]
    if arrivals[drained] == 0:
        print(f"  new requests went only to {' and '.join(receivers) or 'no replica'}")
    else:
        print(f"  {drained} still got {arrivals[drained]} new requests after its drain began")


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
        self.began_at: float | None = None  # wall clock, as the replicas' request logs keep it
        self.events: list[TimelineEvent] = []  # on the clock that starts at `started`

    def _t(self) -> float:
        return time.monotonic() - self._started

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
            self.events.append(mark_event(self._t(), drained, "router told"))
            view = await self._until(client, lambda v: mine(v).get("state") == "draining")
            self.began_at = time.time()
            self.events.append(state_event(self._t(), drained, "draining"))
            in_flight = mine(view)["in_flight"]
            self.say(f"picker: {drained} is DRAINING with {in_flight} streams in flight there")
            view = await self._until(client, lambda v: mine(v).get("in_flight") == 0)
            to_zero = mine(view)["drain"]["time_to_zero_s"]
            self.say(f"picker: its last stream there ended {to_zero:.2f} s after the drain began")
            self.say("removing it from the file (the pod is gone)")
            _write_endpoints(self._path, [{"address": a} for a in replicas if a != drained])
            self.events.append(mark_event(self._t(), drained, "router told"))
            view = await self._until(
                client, lambda v: any(r["address"] == drained for r in v["recent_drains"])
            )
            self.record = next(r for r in view["recent_drains"] if r["address"] == drained)
            self.events.append(state_event(self._t(), drained, "gone"))
            self.say("picker: endpoint gone, drain record closed")


async def run_demo(seconds: float = 8.0, picture: Path | None = DEFAULT_PICTURE) -> int:
    """Start 3 simulated replicas, the picker and Envoy; stream through Envoy; drain one; report and
    draw it (at `picture`; None: no picture); stop all."""
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
            print(f"  status page     http://127.0.0.1:{stack.metrics_port}/status (live during the demo)")
            print(f"  replicas        {', '.join(stack.replicas)}")
            print(f"  endpoints file  {endpoints_file} (the picker re-reads it when it changes)")
            arrivals_at = poisson_arrivals(_RATE, seconds, _TOKENS, seed=7)
            print(
                f"sending {len(arrivals_at)} streaming completions through Envoy over {seconds:.0f} s "
                f"(Poisson arrivals, {_RATE:.0f}/s) ..."
            )
            origin = time.monotonic()  # one clock for the traffic and the drain's steps
            drain = _FileDrain(stack, endpoints_file, origin)
            load, _ = await asyncio.gather(
                replay(stack.url, arrivals_at, origin=origin), drain.run(after_s=seconds * 0.3)
            )
            report = _as_report(load)
            _print_report(report, stack.replicas, stack.replicas[-1])
            arrivals = None
            if drain.began_at is not None:
                arrivals = await asyncio.to_thread(_arrivals_after, stack, drain.began_at)
            print_drain_outcome(report, stack.replicas[-1], arrivals)
            in_flight = await asyncio.to_thread(stack.picker_value, "picker_in_flight")
            print(f"  picker in-flight after the run: {in_flight:.0f}")
            if drain.record is not None:
                _print_record(drain.record)
            log_lines = stack.picker.log_text().splitlines() if stack.picker is not None else []
            closed = [line[line.index("drain closed") :] for line in log_lines if "drain closed" in line]
            if closed:
                print("\nthe picker's log line for it:")
                print(f"  {closed[-1]}")
            if picture is not None:
                drawn = await asyncio.to_thread(
                    draw_rollout, picture, stack.replicas, stack.replicas[-1], load, drain.events
                )
                if drawn is not None:
                    print(f"\nthe rollout picture: {drawn}")
            clean = drain.record is not None and drain.record["picks_after_start"] == 0
            return 0 if clean and not report.failures() else 1
        finally:
            await asyncio.to_thread(stack.stop)
