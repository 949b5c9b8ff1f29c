"""An endpoint source that stops for good turns the picker's readiness NOT_SERVING, with one log line."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from picker.app import PickerApp
from picker.config.model import PickerConfig
from picker.config.sources import load_config
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.sources import static_file
from picker.sources.endpoints import EndpointSources

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVING = health_pb2.HealthCheckResponse.SERVING


async def dies(self: static_file.EndpointsFile) -> None:
    raise RuntimeError("the watch broke")


def file_config(tmp_path: Path, **server: Any) -> PickerConfig:
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 127.0.0.1:9\n")
    return load_config(overrides={"pool": {"endpoints_file": str(path)}, "load": {"scrape": False}, **server})


async def wait_for(predicate: Callable[[], Awaitable[bool]], what: str, within_s: float = 10.0) -> None:
    """Poll `predicate` until it holds, failing after `within_s` (a bound only a broken picker misses)."""
    deadline = time.monotonic() + within_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


async def test_a_source_task_that_dies_is_a_problem_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(static_file.EndpointsFile, "run", dies)
    sources = EndpointSources(file_config(tmp_path), Pool(), Metrics(pool="default"))
    heard: list[str | None] = []
    sources.on_problem(heard.append)
    with caplog.at_level(logging.DEBUG, logger="picker.sources.endpoints"):
        await sources.start()

        async def told() -> bool:
            return bool(heard)

        await wait_for(told, "the problem")
    assert heard == ["endpoint source file stopped unexpectedly (RuntimeError: the watch broke)"]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no longer ready" in errors[0].getMessage() and errors[0].exc_info is None
    await sources.aclose()


async def test_readiness_goes_not_serving_when_the_source_stops_for_good(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    stop_watch = asyncio.Event()

    async def dies_on_cue(self: static_file.EndpointsFile) -> None:
        await stop_watch.wait()
        raise RuntimeError("the watch broke")

    monkeypatch.setattr(static_file.EndpointsFile, "run", dies_on_cue)
    server = {"server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False}}
    app = PickerApp(file_config(tmp_path, **server))
    ports = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.health}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(name: str) -> int:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                return int(reply.status)

            assert await status("readiness") == SERVING
            stop_watch.set()

            async def not_ready() -> bool:
                return await status("readiness") == NOT_SERVING

            await wait_for(not_ready, "readiness NOT_SERVING")
            assert await status("liveness") == SERVING
    finally:
        await app.stop()
