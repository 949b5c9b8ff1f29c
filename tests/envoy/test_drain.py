"""Draining one replica mid-traffic through the real Envoy, from each endpoint source: Kubernetes
EndpointSlices and an InferencePool's pods (the fake API server), the endpoints file, and the admin API.

Each case: 3 simulated replicas serve 60 concurrent streams of ~3 s; one replica's endpoint starts
draining mid-load; once the picker shows it DRAINING, the replica answers new work with 500 (as vLLM
does while it drains); its in-flight streams finish; then it leaves (removed from the source, or
undrained). No stream may fail, no request may reach the draining replica after the picker learned of
the drain, and the drain record must account for every stream that was in flight when it began.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest import http_client
from loadtest.procs import Proc, wait_until
from loadtest.stack import Stack, StackOptions, sim_argv
from loadtest.traffic import run_closed_loop
from picker.drain import scorecard
from tests.kube.fake_apiserver import FakeApiServer, endpoint, terminating

pytestmark = pytest.mark.envoy

SIM_ARGS = ("--ttft-ms", "20", "--itl-ms", "50")
STREAM_TOKENS = 60  # ~3 s per stream
CONCURRENCY = 60
TRAFFIC_S = 9.0
# A request the picker sent just before it learned of the drain reaches the replica a few ms later
# (loopback, measured < 10 ms); anything later than this was sent after the picker knew.
IN_TRANSIT_S = 0.5


class KubeSource:
    """EndpointSlices of Service "vllm" on the fake API server, one slice per replica (own port)."""

    static = False
    exit = "gone"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.fake = FakeApiServer()

    def _slice(self, stack: Stack, index: int, entry: dict[str, Any]) -> None:
        port = stack.replica_ports[index]
        self.fake.put_slice(
            f"vllm-{index}", [entry], ports=[{"name": "http", "port": port, "protocol": "TCP"}]
        )

    async def setup(self, stack: Stack) -> list[str]:
        await self.fake.start()
        for index in range(len(stack.replicas)):
            self._slice(stack, index, endpoint("127.0.0.1"))
        kubeconfig = self.fake.write_kubeconfig(self.workdir / "kubeconfig")
        return ["--kube-service", "vllm", "--kubeconfig", str(kubeconfig), "--kube-target-port", "http"]

    async def drain(self, stack: Stack, index: int) -> None:
        self._slice(stack, index, terminating("127.0.0.1"))  # the pod started terminating

    async def finish(self, stack: Stack, index: int) -> None:
        self.fake.delete_slice(f"vllm-{index}")  # the pod is gone

    async def close(self) -> None:
        await self.fake.stop()


class PodStack(Stack):
    """Replicas as an InferencePool sees them: each its own pod IP, all on the pool's one targetPort.

    Pod IPs are loopback addresses 127.0.0.2, 127.0.0.3, ... (Linux routes all of 127/8 to `lo`),
    so nothing listens beyond this host; one simulator process per "pod", each stopped by its PID.
    """

    def __init__(self, workdir: Path, options: StackOptions) -> None:
        super().__init__(workdir, options)
        self.pod_port = self.replica_ports[0]
        self.pod_sims: list[Proc] = []

    @property
    def pod_ips(self) -> list[str]:
        return [f"127.0.0.{index + 2}" for index in range(self.options.replicas)]

    @property
    def replicas(self) -> list[str]:
        return [f"{ip}:{self.pod_port}" for ip in self.pod_ips]

    def start_sims(self) -> None:
        for index, ip in enumerate(self.pod_ips):
            argv = sim_argv([self.pod_port], [*self.options.sim_args, "--host", ip])
            sim = Proc(f"sim-{index}", argv, self.workdir / f"sim-{index}.log")
            self.pod_sims.append(sim)
            sim.wait_ready(lambda ip=ip: _health(f"{ip}:{self.pod_port}"))

    def stop(self) -> None:
        super().stop()
        for sim in self.pod_sims:
            sim.stop()


def _health(address: str) -> bool:
    try:
        return http_client.get(f"http://{address}/health", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


class PoolSource:
    """The pods of InferencePool "vllm" on the fake API server: `kubectl delete pod` sets their
    deletionTimestamp (the drain), then the pod goes (the end)."""

    static = False
    exit = "gone"
    stack_type = PodStack

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.fake = FakeApiServer()

    async def setup(self, stack: Stack) -> list[str]:
        assert isinstance(stack, PodStack)
        await self.fake.start()
        self.fake.put_pool("vllm", ports=(stack.pod_port,))
        for index, ip in enumerate(stack.pod_ips):
            self.fake.put_pod(f"vllm-{index}", ip)
        self.fake.put_pod("elsewhere", "127.0.0.250", labels={"app": "other"})  # not the pool's
        kubeconfig = self.fake.write_kubeconfig(self.workdir / "kubeconfig")
        return ["--pool-name", "vllm", "--pool-namespace", "default", "--kubeconfig", str(kubeconfig)]

    async def drain(self, stack: Stack, index: int) -> None:
        assert isinstance(stack, PodStack)
        self.fake.put_pod(f"vllm-{index}", stack.pod_ips[index], deleting=True)

    async def finish(self, stack: Stack, index: int) -> None:
        self.fake.delete("pods", f"vllm-{index}")  # the pod is gone

    async def close(self) -> None:
        await self.fake.stop()


class FileSource:
    """The endpoints file, replaced atomically, checked every 0.1 s."""

    static = False
    exit = "gone"

    def __init__(self, workdir: Path) -> None:
        self.path = workdir / "endpoints.yaml"

    def _write(self, entries: list[dict[str, Any]]) -> None:
        temp = self.path.with_suffix(".tmp")
        temp.write_text(json.dumps(entries))  # JSON is YAML
        os.replace(temp, self.path)

    async def setup(self, stack: Stack) -> list[str]:
        self._write([{"address": a} for a in stack.replicas])
        config = self.path.with_name("picker.yaml")
        config.write_text(
            json.dumps({"pool": {"endpoints_file": str(self.path), "endpoints_file_poll_s": 0.1}})
        )
        return ["--config", str(config)]

    async def drain(self, stack: Stack, index: int) -> None:
        self._write([{"address": a, "draining": i == index} for i, a in enumerate(stack.replicas)])

    async def finish(self, stack: Stack, index: int) -> None:
        self._write([{"address": a} for i, a in enumerate(stack.replicas) if i != index])

    async def close(self) -> None:
        pass


class AdminSource:
    """A static list; POST /admin/endpoints/<addr>/drain (what a preStop hook would call), then undrain."""

    static = True
    exit = "ready"

    def __init__(self, workdir: Path) -> None:
        pass

    async def setup(self, stack: Stack) -> list[str]:
        return []

    async def _post(self, stack: Stack, address: str, verb: str) -> None:
        url = f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints/{address}/{verb}"
        async with http_client.AsyncClient(timeout=5) as client:
            response = await client.post(url)
        assert response.status_code == 200, response.text

    async def drain(self, stack: Stack, index: int) -> None:
        await self._post(stack, stack.replicas[index], "drain")

    async def finish(self, stack: Stack, index: int) -> None:
        await self._post(stack, stack.replicas[index], "undrain")

    async def close(self) -> None:
        pass


SOURCES = {"kube": KubeSource, "pool": PoolSource, "file": FileSource, "admin": AdminSource}


def admin_view(stack: Stack) -> dict[str, Any]:
    return http_client.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints", timeout=5).json()


def all_arrived(stack: Stack, address: str) -> bool:
    """Every request the pickers sent to `address` has reached it (its log holds at least their picks).

    A request picked just before the picker learned of a drain can still be on its way: Envoy connects
    it tens of ms later on a loaded machine. A replica that answered 500 from then on would send it to a
    fallback, a move the picker rightly counts, not the clean drain these checks are about (a real vLLM
    stops taking work after its preStop wait, long after)."""
    picks = 0
    for _, _, metrics_port in stack.picker_ports:
        view = http_client.get(f"http://127.0.0.1:{metrics_port}/admin/endpoints", timeout=5).json()
        picks += sum(e["picks"] for e in view["endpoints"] if e["address"] == address)
    return len(stack.sim_requests(address)) >= picks


def endpoint_view(stack: Stack, address: str) -> dict[str, Any] | None:
    return next((e for e in admin_view(stack)["endpoints"] if e["address"] == address), None)


async def until(predicate: Any, within: float, what: str) -> None:
    await asyncio.to_thread(wait_until, predicate, within, 0.02, what)


@pytest.mark.parametrize("kind", list(SOURCES))
async def test_drain_mid_traffic_cuts_nothing_and_sends_nothing_new(tmp_path: Path, kind: str) -> None:
    source = SOURCES[kind](tmp_path)
    stack_type = getattr(source, "stack_type", Stack)
    stack = stack_type(tmp_path, StackOptions(replicas=3, sim_args=SIM_ARGS, static_endpoints=source.static))
    stack.options.picker_args = await source.setup(stack)
    drained, others = stack.replicas[0], stack.replicas[1:]
    try:
        await asyncio.to_thread(stack.start)
        assert sorted(e["address"] for e in admin_view(stack)["endpoints"]) == sorted(stack.replicas)
        traffic = asyncio.create_task(
            run_closed_loop(
                stack.url,
                concurrency=CONCURRENCY,
                max_requests=1000,
                deadline_s=TRAFFIC_S,
                max_tokens=STREAM_TOKENS,
            )
        )
        await until(
            lambda: all(
                stack.picker_value("picker_endpoint_in_flight", endpoint=r) >= 10 for r in stack.replicas
            ),
            15,
            "every replica to carry streams",
        )
        await source.drain(stack, 0)
        await until(
            lambda: (endpoint_view(stack, drained) or {}).get("state") == "draining",
            10,
            "the picker to see it",
        )
        await until(lambda: all_arrived(stack, drained), 10, "the streams sent before the drain to arrive")
        async with http_client.AsyncClient(timeout=5) as client:
            # From now on the replica behaves like a draining vLLM: new completions get HTTP 500.
            fault = await client.post(f"http://{drained}/sim/faults", json={"status": 500})
            assert fault.status_code == 200
            opened = endpoint_view(stack, drained)
            assert opened is not None and opened["drain"] is not None
            started_wall = opened["drain"]["started_wall"]
            await until(lambda: endpoint_view(stack, drained)["in_flight"] == 0, 15, "its streams to end")  # type: ignore[index]
            await client.delete(f"http://{drained}/sim/faults")  # healthy again, should it come back
            await source.finish(stack, 0)
            await until(lambda: bool(admin_view(stack)["recent_drains"]), 10, "the drain record to close")
            report = await traffic
            arrivals = (await client.get(f"http://{drained}/sim/requests")).json()
            elsewhere = [
                r for other in others for r in (await client.get(f"http://{other}/sim/requests")).json()
            ]
        record = admin_view(stack)["recent_drains"][0]

        assert report.failures() == [], report.failures()[:3]  # zero streams cut, no 500s
        assert record["address"] == drained and record["exit"] == source.exit
        assert record["in_flight_at_start"] >= 10
        assert record["ended"]["completed"] == record["in_flight_at_start"], record
        assert sum(record["ended"].values()) == record["in_flight_at_start"]
        assert record["picks_after_start"] == 0 and record["moved_away"] == 0
        assert 0 < record["time_to_zero_s"] < STREAM_TOKENS * 0.05 + 2
        ended_wall = started_wall + record["duration_s"]
        late = [r for r in arrivals if started_wall < r["arrival"] < ended_wall]
        assert all(r["arrival"] <= started_wall + IN_TRANSIT_S for r in late), late
        assert len(late) <= record["in_flight_at_start"]
        assert all(r["outcome"] == "completed" for r in arrivals)  # none got the draining 500
        assert (
            sum(r["arrival"] > started_wall + IN_TRANSIT_S for r in elsewhere) >= CONCURRENCY
        )  # traffic went on
        assert stack.picker_value("picker_drain_picks_after_start_total") == 0
        assert stack.picker_value("picker_picks_not_ready_total") == 0
        assert stack.picker_value("picker_drains_closed_total", exit=source.exit) == 1
        assert "drain closed address=" + drained in stack.picker.log_text()  # type: ignore[union-attr]
        # The scorecard shows the same drain, and its numbers agree with the replica's own log.
        rows = scorecard.score(scorecard.fetch(f"http://127.0.0.1:{stack.metrics_port}"), grace_s=30.0)
        (row,) = [r for r in rows if r["endpoint"] == drained]
        on_replica = [
            r
            for r in arrivals
            if r["arrival"] <= started_wall + IN_TRANSIT_S and (r["end"] is None or r["end"] >= started_wall)
        ]
        assert abs(len(on_replica) - row["in_flight_at_start"]) <= 1  # a stream ending at that very ms
        assert row["completed"] == row["in_flight_at_start"] and row["forced_cuts"] == 0
        assert row["picks_after_start"] == 0
        assert row["unused_grace_s"] == round(30.0 - row["time_to_zero_s"], 3)
        stack.wait_no_leaks()
    finally:
        await asyncio.to_thread(stack.stop)
        await source.close()


async def test_watch_faults_keep_routing_on_the_last_good_view(tmp_path: Path) -> None:
    """Garbage on the watch, the API down, a delete missed while disconnected (history compacted: 410),
    a slice deleted and recreated: streams keep flowing, and the view converges to the API's truth."""
    source = KubeSource(tmp_path)
    stack = Stack(tmp_path, StackOptions(replicas=3, sim_args=SIM_ARGS, static_endpoints=False))
    args = await source.setup(stack)
    config = tmp_path / "picker.yaml"
    config.write_text(json.dumps({"kube": {"backoff_initial_s": 0.05, "backoff_max_s": 0.5}}))
    stack.options.picker_args = [*args, "--config", str(config)]
    fake = source.fake
    removed = stack.replicas[2]

    def lists() -> int:
        return sum(1 for r in fake.requests if r["query"].get("watch") is None)

    try:
        await asyncio.to_thread(stack.start)
        traffic = asyncio.create_task(
            run_closed_loop(stack.url, concurrency=12, max_requests=1000, deadline_s=8.0, max_tokens=20)
        )
        await until(lambda: fake.live_watches == 1, 10, "the picker's watch")
        fake.inject('{"type": "MODIFIED", "object": {"metadata": {"name": "vllm-0"}, "endpoints": 42')
        await until(lambda: lists() == 2 and fake.live_watches == 1, 10, "a relist after the garbage")

        fake.fail_next(5, 503)  # the API is down for a while ...
        fake.drop_watches()
        fake.delete_slice("vllm-2")  # ... and this delete happens while the picker is not watching
        fake.compact()  # and leaves the history: resuming gets 410
        assert (endpoint_view(stack, removed) or {}).get("state") == "ready"  # last good view meanwhile
        await until(lambda: (endpoint_view(stack, removed) or {}).get("state") != "ready", 10, "the removal")
        removed_seen = time.time()  # the picker knew by now (it may still count streams there: GONE)

        fake.delete_slice("vllm-1")  # deleted and recreated (e.g. the controller reshuffling slices)
        source._slice(stack, 1, endpoint("127.0.0.1"))
        report = await traffic
        async with http_client.AsyncClient(timeout=5) as client:
            arrivals = (await client.get(f"http://{removed}/sim/requests")).json()
        assert report.failures() == [], report.failures()[:3]
        assert len(report.results) > 50
        assert sorted(e["address"] for e in admin_view(stack)["endpoints"]) == sorted(stack.replicas[:2])
        assert [r for r in arrivals if r["arrival"] > removed_seen + IN_TRANSIT_S] == []
        assert lists() == 3
        stack.wait_no_leaks()
    finally:
        await asyncio.to_thread(stack.stop)
        await source.close()


async def test_demo_drains_a_replica_and_prints_its_record(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from picker.cli.demo import run_demo

    picture = tmp_path / "rollout.png"
    assert await run_demo(seconds=4.0, picture=picture) == 0
    out = capsys.readouterr().out
    assert "is DRAINING with" in out and "failed or incomplete streams: 0" in out
    assert "new picks after start     0" in out and "exit                      gone" in out
    assert f"the rollout picture: {picture}" in out
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the PNG signature
    assert "drain closed address=" in out
