"""A picker with peers is ready once linked to every one of them (their books in, its picks out), or
after peers.ready_timeout_s: a peer that is down delays it, never keeps it out (picker/app.py)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.procs import free_port
from picker.app import PickerApp
from picker.config.model import PickerConfig
from picker.config.sources import load_config

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def config(tmp_path: Path, ready_timeout_s: float) -> PickerConfig:
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 127.0.0.1:9\n")
    me, absent = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"  # nothing listens on `absent`
    return load_config(
        overrides={
            "pool": {"endpoints_file": str(path)},
            "load": {"scrape": False},
            "server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False},
            "peers": {
                "members": [me, absent],
                "port": int(me.rsplit(":", 1)[1]),
                "advertise": me,
                "ready_timeout_s": ready_timeout_s,
                "secret": "a-peer-secret-of-32-characters-0",
            },
        }
    )


async def readiness(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
        return int(reply.status)


async def test_a_peer_that_is_down_holds_readiness_until_the_timeout_only(tmp_path: Path) -> None:
    app = PickerApp(config(tmp_path, ready_timeout_s=1.0))
    ports = await app.start()
    try:
        assert await readiness(ports.health) == NOT_SERVING  # not linked to its peer
        deadline = time.monotonic() + 10  # a bound only a picker that never lets go misses
        while await readiness(ports.health) != SERVING:
            assert time.monotonic() < deadline, "readiness still held long after peers.ready_timeout_s"
            await asyncio.sleep(0.02)
    finally:
        await app.stop()


async def test_no_wait_when_the_timeout_is_zero(tmp_path: Path) -> None:
    app = PickerApp(config(tmp_path, ready_timeout_s=0))
    ports = await app.start()
    try:
        assert await readiness(ports.health) == SERVING
    finally:
        await app.stop()
