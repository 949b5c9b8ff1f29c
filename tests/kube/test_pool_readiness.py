"""A picker pointed at an InferencePool that is missing (or becomes invalid) is not ready; it becomes
ready once the pool is usable. Through the real PickerApp and its gRPC health service."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.app import PickerApp
from picker.config.sources import load_config
from tests.kube.fake_apiserver import FakeApiServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_readiness_follows_whether_the_pool_is_usable(fake: FakeApiServer, kubeconfig: Path) -> None:
    fake.put_pod("vllm-0", "10.0.0.1")
    config = load_config(
        overrides={
            "server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False},
            "kube": {"pool_name": "vllm", "kubeconfig": str(kubeconfig), "backoff_initial_s": 0.02},
            "load": {"scrape": False},
        }
    )
    app = PickerApp(config)
    ports = await app.start()
    statuses: dict[str, int] = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.health}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def poll() -> None:
                for name in ("readiness", "liveness"):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    statuses[name] = int(reply.status)

            async def becomes(name: str, status: int, what: str) -> None:
                deadline = asyncio.get_running_loop().time() + 10  # a bound only a broken picker misses
                await poll()
                while statuses[name] != status:
                    assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
                    await asyncio.sleep(0.02)
                    await poll()

            await becomes("readiness", NOT_SERVING, "not ready: no pool")
            assert statuses["liveness"] == SERVING and len(app.pool) == 0
            fake.put_pool("vllm")
            await becomes("readiness", SERVING, "ready: the pool exists")
            assert [e.address for e in app.pool.ready()] == ["10.0.0.1:8000"]
            fake.put_pool("vllm", ports=())
            await becomes("readiness", NOT_SERVING, "not ready: the pool is invalid")
            assert [e.address for e in app.pool.ready()] == ["10.0.0.1:8000"]  # routing goes on
    finally:
        await app.stop()
