"""The InferencePool source through the real Envoy: a change of the pool's selector and of its
targetPorts takes effect live, while traffic flows, with nothing restarted and no request failing.

Each "pod" is a simulator on its own loopback IP (tests/envoy/test_drain.py's PodStack) listening on
two ports, as a data-parallel engine does; the pool starts with one targetPort.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from loadtest import http_client
from loadtest.procs import Proc, free_port, wait_until
from loadtest.stack import StackOptions, sim_argv
from loadtest.traffic import run_closed_loop
from tests.envoy.test_drain import IN_TRANSIT_S, SIM_ARGS, PodStack, _health
from tests.kube.fake_apiserver import FakeApiServer

pytestmark = pytest.mark.envoy

STABLE = {"app": "vllm", "track": "stable"}
CANARY = {"app": "vllm", "track": "canary"}


class RankedPodStack(PodStack):
    """Each pod serves a second port (a second data-parallel rank) that the pool does not target yet."""

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        super().__init__(workdir, options)
        self.rank_port = free_port()

    def start_sims(self) -> None:
        for index, ip in enumerate(self.pod_ips):
            argv = sim_argv([self.pod_port, self.rank_port], [*self.options.sim_args, "--host", ip])
            sim = Proc(f"sim-{index}", argv, self.workdir / f"sim-{index}.log")
            self.pod_sims.append(sim)
            for port in (self.pod_port, self.rank_port):
                sim.wait_ready(lambda ip=ip, port=port: _health(f"{ip}:{port}"))


def live_endpoints(stack: PodStack) -> set[str]:
    view = http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()
    return {e["address"] for e in view["endpoints"] if e["state"] != "gone"}


def arrivals(address: str) -> list[dict[str, Any]]:
    return http_client.get(f"http://{address}/sim/requests", timeout=5).json()  # type: ignore[no-any-return]


async def until(predicate: Any, within: float, what: str) -> None:
    await asyncio.to_thread(wait_until, predicate, within, 0.02, what)


async def test_selector_and_target_ports_change_live_through_envoy(tmp_path: Path) -> None:
    fake = await FakeApiServer().start()
    stack = RankedPodStack(tmp_path, StackOptions(replicas=3, sim_args=SIM_ARGS, static_endpoints=False))
    ips = stack.pod_ips
    fake.put_pool("vllm", selector={"app": "vllm"}, ports=(stack.pod_port,))
    for index, ip in enumerate(ips):
        fake.put_pod(f"vllm-{index}", ip, labels=CANARY if index == 2 else STABLE)
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig")
    stack.options.picker_args = ["--pool-name", "vllm", "--kubeconfig", str(kubeconfig)]
    canary = f"{ips[2]}:{stack.pod_port}"
    try:
        await asyncio.to_thread(stack.start)
        assert live_endpoints(stack) == {f"{ip}:{stack.pod_port}" for ip in ips}
        traffic = asyncio.create_task(
            run_closed_loop(stack.url, concurrency=12, max_requests=600, deadline_s=10.0, max_tokens=10)
        )
        await until(lambda: len(arrivals(canary)) >= 3, 10, "traffic on the canary pod")

        fake.put_pool("vllm", selector=STABLE, ports=(stack.pod_port,))  # the canary leaves the pool
        await until(lambda: canary not in live_endpoints(stack), 10, "the new selector")
        seen_wall = time.time()
        assert live_endpoints(stack) == {f"{ip}:{stack.pod_port}" for ip in ips[:2]}

        fake.put_pool("vllm", selector=STABLE, ports=(stack.pod_port, stack.rank_port))  # a second rank
        ranks = {f"{ip}:{stack.rank_port}" for ip in ips[:2]}
        await until(lambda: ranks <= live_endpoints(stack), 10, "the new targetPorts")
        await until(lambda: all(arrivals(r) for r in ranks), 10, "traffic on the second ranks")
        report = await traffic
        late = [r for r in arrivals(canary) if r["arrival"] > seen_wall + IN_TRANSIT_S]
        assert report.failures() == [], report.failures()[:3]
        assert late == []  # nothing new for a pod that left the pool
        log = stack.picker.log_text()  # type: ignore[union-attr]
        assert log.count("kube list pods=") == 2  # the first list and the new selector's, no more
        assert "InferencePool default/vllm selector=app=vllm,track=stable" in log
        assert f"InferencePool default/vllm target_ports={stack.pod_port},{stack.rank_port}" in log
        stack.wait_no_leaks()
    finally:
        await asyncio.to_thread(stack.stop)
        await fake.stop()
