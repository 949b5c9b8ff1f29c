"""A rolling update as a Deployment controller does it, and one run of it under load.

`roll` follows maxSurge / maxUnavailable: a replacement is started while the replicas that are not
terminating number fewer than N + surge; an old replica is terminated while the ready ones would still
number at least N - unavailable without it. Terminations run concurrently (the controller does not
wait for a terminating pod to exit before it goes on), each with the setup's own sequence.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtest.rollout.fleet import Fleet
from loadtest.rollout.load import Arrival, LoadReport, replay
from loadtest.rollout.setups import PickerSetup, PoolSetup, ProxyResumeSetup, RoundRobinSetup
from loadtest.rollout.timeline import Panel, TimelineEvent


@dataclass(frozen=True)
class RolloutOptions:
    replicas: int = 3
    rate: float = 20.0  # requests per second, Poisson
    duration_s: float = 20.0  # arrivals are sent for this long
    tokens: tuple[int, int] = (20, 120)  # max_tokens, uniform
    surge: int = 1
    unavailable: int = 0
    source: str = "file"  # the picker's endpoint source: file | admin
    rollout_at_s: float = 3.0  # the rollout begins this long after the load
    propagation_s: float = 1.0  # endpoint removal reaching the router
    shutdown_timeout_s: float = 20.0  # the replicas' vLLM --shutdown-timeout (drain mode)
    seed: int = 7
    sim_args: tuple[str, ...] = ("--ttft-ms", "40", "--itl-ms", "25", "--itl-jitter-ms", "3")
    real_vllm: bool = False  # real vLLM CPU servers (loadtest/realvllm) instead of simulators
    model: str = "tiny-llama"  # the served model name (the launcher's tiny model with real vLLM)
    kill_after_s: float = 1.0  # the proxy-resume run: one old replica SIGKILLed this long into the rollout


# With --real-vllm: each replica is a ~1.9 GB vLLM that takes ~25 s to start on an idle 2-core machine
# but 100-120 s while two others serve 4 requests/s on it (measured), so a small pool, a low rate and
# short streams (about 350 tokens/s per stream when idle), arrivals long enough to cover two such
# starts and the drains, and vLLM's drain budget.
REAL_VLLM_DEFAULTS = {
    "replicas": 2,
    "rate": 2.0,
    "duration_s": 240.0,
    "tokens": (30, 150),
    "rollout_at_s": 5.0,
    "shutdown_timeout_s": 30.0,
}
VLLM_START_BUDGET_S = 120.0  # per replacement, in the bound on the whole rollout


@dataclass
class SetupRun:
    title: str
    load: LoadReport
    events: list[TimelineEvent]
    drains: list[dict[str, Any]] | None = None
    rollout_s: float = 0.0
    lane_names: dict[str, str] = field(default_factory=dict)
    load_avg: tuple[float, float] = (0.0, 0.0)  # the machine's 1-min load average at start and end
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds of the routers, whole run
    resumes: dict[str, float] | None = None  # picker proxy with resume: streams continued, by why


async def roll(fleet: Fleet, setup: PoolSetup, surge: int, unavailable: int) -> None:
    """Replace every replica of `fleet.first` by one of `fleet.replacements`."""
    if surge < 0 or unavailable < 0 or surge + unavailable < 1:
        raise ValueError("surge and unavailable must be >= 0 and not both 0")
    n = len(fleet.first)
    old, unstarted = list(fleet.first), list(fleet.replacements)
    starting: set[asyncio.Task[None]] = set()
    ready_new = 0

    async def bring_up(address: str) -> None:
        await fleet.start(address)
        await setup.add(address)

    async with asyncio.TaskGroup() as group:
        while old or unstarted or starting:
            moved = False
            while unstarted and len(old) + (n - len(unstarted)) < n + surge:
                starting.add(group.create_task(bring_up(unstarted.pop(0))))
                moved = True
            while old and len(old) + ready_new - 1 >= n - unavailable:
                group.create_task(setup.terminate(old.pop(0)))
                moved = True
            if not starting:
                if moved:
                    continue
                if old or unstarted:
                    raise RuntimeError("rollout stuck: nothing starting and nothing may be terminated")
                break
            done, _ = await asyncio.wait(starting, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            starting -= done
            ready_new += len(done)


async def run_setup(kind: str, options: RolloutOptions, arrivals: list[Arrival], workdir: Path) -> SetupRun:
    """Start a fleet and a setup, replay `arrivals` through it, roll every replica; stop everything."""
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    sim_args = [*options.sim_args, "--shutdown-timeout", str(options.shutdown_timeout_s)]
    vllm_shutdown = options.shutdown_timeout_s if options.real_vllm else None
    fleet = Fleet(workdir, options.replicas, sim_args, real_vllm_shutdown_s=vllm_shutdown)
    grace_s = options.shutdown_timeout_s + 5
    setup: PoolSetup
    if kind == "round-robin":
        setup = RoundRobinSetup(workdir, fleet, propagation_s=options.propagation_s, grace_s=grace_s)
    elif kind == "proxy-resume":
        setup = ProxyResumeSetup(workdir, fleet, propagation_s=options.propagation_s, grace_s=grace_s)
    else:
        setup = PickerSetup(
            workdir, fleet, propagation_s=options.propagation_s, grace_s=grace_s, source=options.source
        )
    stop_sampling = asyncio.Event()
    try:
        await asyncio.gather(*(fleet.start(a) for a in fleet.first))
        await setup.start()
        load_before = os.getloadavg()[0]
        fleet.restart_clock()
        tag = kind if options.real_vllm else ""  # real vLLM: name requests for the access log
        load = asyncio.create_task(
            replay(setup.url, arrivals, origin=fleet.origin, model=options.model, tag=tag)
        )
        sampler = asyncio.create_task(fleet.sample(stop_sampling)) if options.real_vllm else None
        await asyncio.sleep(options.rollout_at_s)  # the rollout starts into steady load
        began = time.monotonic()
        bound = 60.0 + options.replicas * (options.shutdown_timeout_s + 10)
        if options.real_vllm:
            bound += options.replicas * VLLM_START_BUDGET_S
        killing = (
            asyncio.create_task(_kill_one(fleet, options.kill_after_s)) if kind == "proxy-resume" else None
        )
        await asyncio.wait_for(roll(fleet, setup, options.surge, options.unavailable), bound)
        if killing is not None:
            await killing
        rollout_s = time.monotonic() - began
        report = await load
        stop_sampling.set()
        if sampler is not None:
            await sampler
            reached = sum(1 for o in report.outcomes if o.result.status is not None)
            report.attribute(await asyncio.to_thread(setup.upstreams, reached))
        drains = await asyncio.to_thread(setup.drain_rows)
        resumes = await asyncio.to_thread(setup.resumes) if isinstance(setup, ProxyResumeSetup) else None
        events = [*fleet.events, *report.timeline_events()]
        load_avg = (load_before, os.getloadavg()[0])
        return SetupRun(
            setup.title, report, events, drains, rollout_s, fleet.lane_names(), load_avg, setup.cpu(), resumes
        )
    finally:
        stop_sampling.set()
        await asyncio.to_thread(setup.stop)
        await asyncio.to_thread(fleet.stop_all)


async def _kill_one(fleet: Fleet, after_s: float) -> None:
    """A crash in the middle of the rollout: the last of the old replicas (the one replaced last)
    is SIGKILLed `after_s` into it, its streams cut mid-sentence."""
    await asyncio.sleep(after_s)  # the moment of the crash, not a synchronisation
    victim = fleet.first[-1]
    fleet.moment(victim, "SIGKILL")
    fleet.procs[victim].signal(signal.SIGKILL)


def panels(runs: list[SetupRun], verdicts: list[str]) -> list[Panel]:
    return [
        Panel(run.title, run.events, note, run.lane_names) for run, note in zip(runs, verdicts, strict=True)
    ]
