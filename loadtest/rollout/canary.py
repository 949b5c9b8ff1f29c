"""`python -m loadtest.rollout.canary`: the canary picture (`make rollout-canary`).

Two runs through `picker proxy` over two stable simulators (v1) and one candidate (v2), each under
a closed loop of short streams: a good candidate promoted step by step, and a bad one (3x the TTFT)
rolled back. One panel each: a lane per replica (its state, its streams in flight, each weight
step and the rollback as ticks on the candidate's lane), the p99 TTFT per second beneath, and the
gate readings at the rollback in the panel's note. `CanaryStack` is the same harness the tests use
(tests/frontends/test_canary.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtest import http_client
from loadtest.procs import Proc, free_port
from loadtest.proxy_stack import ProxyStack
from loadtest.rollout.timeline import Panel, TimelineEvent, draw, mark_event, state_event, stream_event
from loadtest.stack import Stack, StackOptions, health_ok, sim_argv
from loadtest.traffic import Result, completion_body, stream_one

STABLE_SIM = ("--ttft-ms", "20", "--itl-ms", "5")
BAD_SIM = ("--ttft-ms", "60", "--itl-ms", "5")  # 3x the stable TTFT
LABEL = "app.kubernetes.io/version"


class CanaryStack:
    """Two stable replicas (the stack's), one candidate, the picker reading both groups' labels."""

    def __init__(
        self,
        workdir: Path,
        frontend: str,
        candidate_sim: tuple[str, ...],
        rollout: dict[str, Any],
        shape: dict[str, Any] | None = None,
    ):
        """`shape`: more StackOptions for the Envoy frontend (a gateway's template, its access log)."""
        self.candidate_port = free_port()
        self.candidate = f"127.0.0.1:{self.candidate_port}"
        self.sim = Proc(
            "sim-candidate", sim_argv([self.candidate_port], candidate_sim), workdir / "sim-v2.log"
        )
        self.sim.wait_ready(lambda: health_ok(self.candidate_port))
        endpoints, config = workdir / "endpoints.yaml", workdir / "picker.yaml"
        rollout = {"group_label": LABEL, "stable": "v1", "candidate": "v2", "tick_s": 0.1, **rollout}
        pool = {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1}
        config.write_text(json.dumps({"pool": pool, "rollout": rollout}))
        options = StackOptions(
            replicas=2,
            sim_args=STABLE_SIM,
            static_endpoints=False,
            picker_args=("--config", str(config), "--no-scrape"),
            # a gateway's pool cluster lists every member of the pool itself, the candidate too
            **({"extra_envoy_endpoints": (self.candidate,), **shape} if shape else {}),
        )
        self.stack = (ProxyStack if frontend == "proxy" else Stack)(workdir, options)
        listed = [{"address": a, "labels": {LABEL: "v1"}} for a in self.stack.replicas]
        listed.append({"address": self.candidate, "labels": {LABEL: "v2"}})
        endpoints.write_text(json.dumps(listed))

    def start(self) -> None:
        try:
            self.stack.start()
        except BaseException:
            self.sim.stop()
            raise

    def stop(self) -> None:
        self.stack.stop()
        self.sim.stop()

    def admin(self, path: str) -> dict[str, Any]:
        return http_client.get(f"http://127.0.0.1:{self.stack.metrics_port}{path}", timeout=5).json()  # type: ignore[no-any-return]

    def rollout(self) -> dict[str, Any]:
        return self.admin("/admin/rollout")["rollout"]  # type: ignore[no-any-return]

    async def until_phase(self, phase: str, traffic: asyncio.Task[Any], within_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while (status := await asyncio.to_thread(self.rollout))["phase"] != phase:
            assert time.monotonic() < deadline, f"never {phase}: {status}"
            assert not traffic.done(), f"traffic ended before {phase}: {status}"
            await asyncio.sleep(0.05)  # polling the condition above
        return status


async def closed_loop(
    url: str, concurrency: int, max_requests: int, deadline_s: float
) -> list[tuple[float, Result]]:
    """Short streams one after another per worker; each with the wall time it was sent."""
    out: list[tuple[float, Result]] = []
    stop_at = time.monotonic() + deadline_s
    async with http_client.AsyncClient(timeout=30) as client:

        async def worker() -> None:
            while len(out) < max_requests and time.monotonic() < stop_at:
                sent = time.time()
                out.append((sent, await stream_one(client, url, completion_body(4))))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


async def run_case(
    workdir: Path, title: str, candidate_sim: tuple[str, ...], rollout: dict[str, Any], until: str
) -> Panel:
    canary = CanaryStack(workdir, "proxy", candidate_sim, rollout)
    canary.start()
    try:
        started = time.time()
        traffic = asyncio.create_task(closed_loop(canary.stack.url, 12, 6000, 40))
        status = await canary.until_phase(until, traffic, 35)
        await asyncio.sleep(2)  # what comes after it
        results = await traffic
        endpoints = canary.admin("/admin/endpoints")["endpoints"]
    finally:
        canary.stop()
    wall = status["clock_to_wall_s"]
    events: list[TimelineEvent] = [state_event(0.0, e["address"], "ready") for e in endpoints]
    for e in endpoints:
        if e["state"] == "draining":
            events.append(state_event(e["since"] - started, e["address"], "draining"))
    for sent, result in results:
        if result.replica:
            ttft = result.ttft_s
            events.append(
                stream_event(sent - started, sent - started + result.duration_s, result.replica, ttft)
            )
    note = ""
    for item in status["history"]:
        at = item["at_s"] + wall - started
        if item["event"] in ("step", "promoted"):
            events.append(mark_event(at, canary.candidate, "weight step"))
        if item["event"] == "rolled-back":
            events.append(mark_event(at, canary.candidate, "rolled back"))
    steps = [
        f"{h['weight']} % ({h['share']} % measured)" for h in status["history"] if h["event"] == "step-ended"
    ]
    if until == "promoted":
        note = "steps: " + ", ".join(steps) + " -> promoted"
    else:
        gate = next(g for g in status["rollback"]["gates"] if g["verdict"] == "fail")
        note = (
            f"rolled back at {status['rollback']['at_s'] + wall - started:.1f} s: {gate['gate']} candidate "
            f"{gate['candidate'] * 1000:.0f} ms vs stable {gate['stable'] * 1000:.0f} ms "
            f"(limit {gate['limit'] * 1000:.0f}); "
            f"{sum(1 for _, r in results if not r.ok)} of {len(results)} requests failed"
        )
    names = {a: f"stable {a}" for a in [e["address"] for e in endpoints] if a != canary.candidate}
    names[canary.candidate] = f"candidate {canary.candidate}"
    print(f"{title}: {note}")
    return Panel(title, events, note, names)


async def main_async(png: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        good_dir, bad_dir = Path(tmp) / "good", Path(tmp) / "bad"
        good_dir.mkdir()
        bad_dir.mkdir()
        good = await run_case(
            good_dir,
            "good candidate (same TTFT): steps 10, 50, 100 %",
            STABLE_SIM,
            {"steps": [10, 50, 100], "step_interval_s": 4, "window_s": 4, "min_samples": 10},
            "promoted",
        )
        bad = await run_case(
            bad_dir,
            "bad candidate (3x the TTFT) at 5 %",
            BAD_SIM,
            {"steps": [5, 25, 50, 100], "window_s": 3, "min_samples": 15},
            "rolled-back",
        )
    draw(
        [good, bad],
        png,
        title="Canary through picker proxy: two stable replicas (v1), one candidate (v2)",
        caption="Green dotted ticks: the candidate's weight stepped up; red: a gate failed, the weight "
        "went to 0 and the candidate drained (its streams ran to their end).",
    )
    print(f"wrote {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, default=Path("docs/img/rollout-canary.png"))
    args = parser.parse_args()
    asyncio.run(main_async(args.png))


if __name__ == "__main__":
    main()
