"""One run of the scale-down benchmark: the cluster (cluster.py), `picker proxy` over its EndpointSlices,
seeded Poisson streaming load of mixed lengths, and the scale-downs, with or without the picker's
pod-deletion-cost.

Time is the issue's divided by `TIME_SCALE` (10): a token every 0.1 s, long streams of 6-12 s (60-120
s), a grace period of 6 s (60 s), an annotation interval of 1 s (10 s). The Deployment starts at
`replicas`; after a warm-up longer than the longest stream, the HPA takes it to `scale_to`; the
replicas come back (a scale-up), the load settles, and the next cycle begins.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest import http_client
from loadtest.procs import Proc, free_port, port_open
from loadtest.rollout.load import Arrival, LoadReport, Outcome
from loadtest.scale_down.cluster import SERVICE, Cluster, Deletion, shutdown_all
from loadtest.sse_client import stream_request
from loadtest.stack import health_ok, parse_metrics
from loadtest.traffic import completion_body
from tests.kube.fake_apiserver import FakeApiServer

TIME_SCALE = 10.0  # the seconds per second here


@dataclass(frozen=True)
class Options:
    replicas: int = 4
    scale_to: int = 2
    cycles: int = 6
    # An HPA scales down when demand is low: about two streams per replica (an over-provisioned pool)
    rate: float = 2.0  # requests per second, Poisson
    long_share: float = 0.35
    short_tokens: tuple[int, int] = (5, 30)  # 0.5-3 s here (5-30 s at the scale)
    long_tokens: tuple[int, int] = (60, 120)  # 6-12 s here (60-120 s)
    itl_ms: float = 100.0
    eos_rate: float = 0.3  # of the requests, those that stop before max_tokens (the picker cannot know)
    grace_s: float = 6.0  # terminationGracePeriodSeconds (60 s)
    warmup_s: float = 15.0  # before the first scale-down: longer than the longest stream
    settle_s: float = 12.0  # after a scale-up, before the next scale-down
    interval_s: float = 1.0  # kube.deletion_cost_interval_s (10 s)
    margin_s: float = 0.5  # scale_down.margin_s (5 s)
    step_s: float = 0.1  # scale_down.step_s (1 s)
    steer_s: float = 3.0  # scale_down.steer_s (30 s, its default); 0: the placement is not steered
    seed: int = 7

    @property
    def cycle_s(self) -> float:
        return self.grace_s + 1.0 + self.settle_s

    @property
    def duration_s(self) -> float:
        """Arrivals run until the last scale-down's drains are over."""
        return self.warmup_s + (self.cycles - 1) * self.cycle_s + self.grace_s + 1.0

    @property
    def ports_needed(self) -> int:
        return self.replicas + (self.cycles - 1) * (self.replicas - self.scale_to)


@dataclass
class ArmRun:
    title: str
    ranked: bool
    load: LoadReport
    deletions: list[Deletion]
    patches: list[dict[str, Any]]  # the fake API server's PATCH log
    quiet_writes: int  # annotation writes while nothing changed (after the load, streams over)
    picker_metrics: dict[str, float] = field(default_factory=dict)


def mixed_arrivals(options: Options) -> list[Arrival]:
    """Exponential gaps at `rate`; a `long_share` of long streams, the rest short; seeded."""
    rng = random.Random(options.seed)
    arrivals, at = [], rng.expovariate(options.rate)
    while at < options.duration_s:
        tokens = options.long_tokens if rng.random() < options.long_share else options.short_tokens
        arrivals.append(Arrival(at, rng.randint(*tokens)))
        at += rng.expovariate(options.rate)
    return arrivals


async def replay(url: str, arrivals: list[Arrival], origin: float) -> LoadReport:
    """Every arrival sent at its time (open loop), without ignore_eos: some stop early."""
    report = LoadReport()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)

    async def one(client: httpx.AsyncClient, arrival: Arrival) -> None:
        await asyncio.sleep(max(0.0, arrival.at_s - (time.monotonic() - origin)))  # its arrival time
        sent = time.monotonic() - origin
        body = {**completion_body(arrival.max_tokens), "ignore_eos": False}
        result = await stream_request(client, url + "/v1/completions", body, read_timeout=10.0)
        report.outcomes.append(Outcome(sent, result))

    async with http_client.AsyncClient(limits=limits) as client, asyncio.TaskGroup() as group:
        for arrival in arrivals:
            group.create_task(one(client, arrival))
    report.outcomes.sort(key=lambda o: o.sent_s)
    report.wall_s = time.monotonic() - origin
    return report


def _picker_config(options: Options, ranked: bool, kubeconfig: Path, path: Path) -> Path:
    import yaml

    config = {
        "kube": {
            "service": SERVICE,
            "kubeconfig": str(kubeconfig),
            "deletion_cost": ranked,
            "deletion_cost_interval_s": options.interval_s,
            "backoff_initial_s": 0.05,
            "backoff_max_s": 0.5,
        },
        "scale_down": {"margin_s": options.margin_s, "step_s": options.step_s, "steer_s": options.steer_s},
    }
    path.write_text(yaml.safe_dump(config))
    return path


async def run_arm(ranked: bool, options: Options, arrivals: list[Arrival], workdir: Path) -> ArmRun:
    """Start everything, replay `arrivals`, scale down and up `cycles` times; stop everything."""
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    fake = await FakeApiServer().start()
    ports = [free_port() for _ in range(options.ports_needed)]
    sim_argv = [sys.executable, "-m", "vllm_sim", *(a for p in ports for a in ("--port", str(p)))]
    sim_argv += ["--ttft-ms", "50", "--itl-ms", str(options.itl_ms), "--itl-jitter-ms", "5"]
    sim_argv += ["--eos-rate", str(options.eos_rate), "--seed", str(options.seed)]
    sim_argv += ["--shutdown-timeout", str(options.grace_s), "--on-drain-timeout", "abort"]
    sim = Proc("sim", sim_argv, workdir / "sim.log")
    picker: Proc | None = None
    try:
        await asyncio.to_thread(sim.wait_ready, lambda: all(health_ok(p) for p in ports), 30.0)
        cluster = Cluster(fake, ports, options.grace_s, time.monotonic())
        for age_s in (3600.0, 1800.0, 900.0, 300.0, 120.0, 60.0)[: options.replicas]:
            cluster.add_pod(age_s)  # earlier scale-ups: the pods' ages differ
        kubeconfig = fake.write_kubeconfig(workdir / "kubeconfig")
        listen, metrics_port = free_port(), free_port()
        argv = [sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1"]
        argv += ["--port", str(listen), "--metrics-port", str(metrics_port)]
        argv += ["--config", str(_picker_config(options, ranked, kubeconfig, workdir / "picker.yaml"))]
        picker = Proc("picker", argv, workdir / "picker.log")

        def ready() -> bool:
            if not ("picker proxy ready" in picker.log_text() and port_open(listen)):  # type: ignore[union-attr]
                return False
            text = http_client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1.0).text
            return parse_metrics(text).get(("picker_ready_endpoints", ()), 0) == options.replicas

        await asyncio.to_thread(picker.wait_ready, ready, 30.0)
        origin = cluster.origin = time.monotonic()
        load = asyncio.create_task(replay(f"http://127.0.0.1:{listen}", arrivals, origin))
        await _scale(cluster, options, origin)
        report = await load
        quiet_from = len(fake.patches)
        await asyncio.sleep(3 * options.interval_s)  # a measuring window: nothing changes, nothing is written
        quiet = sum(1 for p in fake.patches[quiet_from:] if p["status"] == 200)
        text = (await asyncio.to_thread(http_client.get, f"http://127.0.0.1:{metrics_port}/metrics")).text
        figures = {
            f"{name}{dict(labels)}": value
            for (name, labels), value in parse_metrics(text).items()
            if name.startswith("picker_deletion_cost")
        }
        title = "the picker's pod-deletion-cost" if ranked else "the controller's default choice"
        return ArmRun(title, ranked, report, cluster.deletions, list(fake.patches), quiet, figures)
    finally:
        await shutdown_all(ports)
        if picker is not None:
            await asyncio.to_thread(picker.stop)
        await asyncio.to_thread(sim.stop)
        await fake.stop()


async def _scale(cluster: Cluster, options: Options, origin: float) -> None:
    """The HPA's decisions on the run's clock: down to `scale_to`, back up, `cycles` times."""

    async def until(at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - (time.monotonic() - origin)))  # the scenario's schedule

    for cycle in range(options.cycles):
        start = options.warmup_s + cycle * options.cycle_s
        await until(start)
        gone = await cluster.scale_down(options.replicas - options.scale_to)
        reaping = [asyncio.create_task(cluster.reap(d, options.grace_s + 3.0)) for d in gone]
        await until(start + options.grace_s + 1.0)
        await asyncio.gather(*reaping)
        if cycle < options.cycles - 1:
            for _ in range(options.replicas - options.scale_to):
                cluster.add_pod()
