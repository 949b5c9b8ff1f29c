"""The reference picker's Helm chart with only the image changed (issue 21): `picker serve` started with
exactly the container arguments and environment the chart renders (one replica and two; with an
InferencePool and with `--endpoint-selector`) becomes ready on the probes the chart sets and routes.
The API server is the fake one (tests/kube); the model servers are simulators."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.ngf_client import ShimClient
from loadtest.procs import Proc, async_wait_until, free_port
from loadtest.stack import health_ok, sim_argv
from loadtest.traffic import completion_body
from tests.gateways.reference_chart import DEFAULT_PLUGINS, Values, container_args, container_env, probes
from tests.kube.fake_apiserver import FakeApiServer

BODY = json.dumps(completion_body(4, stream=False)).encode()


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = await FakeApiServer().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def sims(tmp_path: Path) -> AsyncIterator[list[int]]:
    ports = [free_port(), free_port()]
    proc = Proc("sim", sim_argv(ports, ("--ttft-ms", "5", "--itl-ms", "5")), tmp_path / "sim.log")
    try:
        for port in ports:
            await async_wait_until(lambda p=port: health_ok(p), 20, what="simulator")
        yield ports
    finally:
        proc.stop()


def serving(port: int, service: str) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            answer = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=1
            )
        except grpc.RpcError:
            return False
    return answer.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("replicas", "selector"),
    [(1, False), (2, False), (1, True)],
    ids=["one-replica-pool", "two-replicas-pool", "endpoint-selector"],
)
async def test_the_charts_arguments_start_a_picker_that_routes(
    tmp_path: Path, fake: FakeApiServer, sims: list[int], replicas: int, selector: bool
) -> None:
    fake.put_pod("vllm-0", "127.0.0.1", labels={"app": "vllm-llama"})
    if not selector:
        fake.put_pool("vllm-llama", selector={"app": "vllm-llama"}, ports=tuple(sims))
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "default-plugins.yaml").write_text(DEFAULT_PLUGINS)
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    values = Values(
        replicas=replicas,
        config_mount=str(config_dir),
        health_port=health_port,
        endpoint_selector="app=vllm-llama" if selector else None,
        endpoint_target_ports=tuple(sims) if selector else (),
        # the values a user sets for ports and the listen address (inferenceExtension.flags)
        flags={"grpc-port": grpc_port, "metrics-port": metrics_port, "bind-address": "127.0.0.1"},
    )
    args = container_args(values)
    env = {
        **container_env(values, pod_name="vllm-llama-epp-0"),
        "KUBECONFIG": str(fake.write_kubeconfig(tmp_path / "kc")),
    }
    proc = Proc("picker", [sys.executable, "-m", "picker", "serve", *args], tmp_path / "picker.log", env=env)
    try:
        probe = probes(values)["readiness"]
        await async_wait_until(lambda: not proc.alive() or serving(health_port, probe), 20, what="readiness")
        assert proc.alive(), proc.log_text()
        assert serving(health_port, probes(values)["liveness"])
        client = ShimClient(f"127.0.0.1:{grpc_port}", tls=True)  # the chart leaves TLS on
        chosen = {client.ask(BODY).endpoint for _ in range(10)}
        assert chosen == {f"127.0.0.1:{port}" for port in sims}
        lines = [json.loads(line) for line in proc.log_text().splitlines() if line.startswith("{")]
        assert lines, "--zap-encoder json: JSON log lines"
        said = " ".join(line["msg"] for line in lines)
        assert "plugin configuration: affinity" in said and "'load_weight': 4.0" in said
        # replicas > 1: --ha-enable-leader-election; alone on the Lease, this one leads and is ready
        assert ("leader lease acquired" in said) == (replicas > 1)
    finally:
        proc.stop()


def test_a_flag_neither_mapped_nor_accepted_stops_the_picker_naming_it(tmp_path: Path) -> None:
    proc = Proc("picker", [sys.executable, "-m", "picker", "serve", "--no-such-flag=1"], tmp_path / "p.log")
    assert proc.wait_exit(30) == 2
    assert "--no-such-flag" in proc.log_text()


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--pool-group=inference.networking.x-k8s.io", "--pool-group"),
        ("--refresh-metrics-interval=soon", "--refresh-metrics-interval"),
        ("--model-server-metrics-https-insecure-skip-verify=false", "insecure-skip-verify"),
    ],
)
def test_a_reference_value_this_picker_cannot_honour_is_an_error_naming_it(
    tmp_path: Path, flag: str, named: str
) -> None:
    proc = Proc("picker", [sys.executable, "-m", "picker", "serve", flag], tmp_path / "p.log")
    assert proc.wait_exit(30) == 2
    assert named in proc.log_text()
