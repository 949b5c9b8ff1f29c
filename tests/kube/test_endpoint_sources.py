"""EndpointSources: the configured source is loaded first, then run as one owned task, then stopped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from loadtest.procs import async_wait_until
from picker.config.model import ConfigError
from picker.config.sources import load_config
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.sources.endpoints import EndpointSources
from picker.sources.static_file import EndpointsFile
from tests.kube.fake_apiserver import FakeApiServer, endpoint, terminating


def kube_config(kubeconfig: Path) -> dict[str, object]:
    return {
        "kube": {
            "service": "vllm",
            "kubeconfig": str(kubeconfig),
            "backoff_initial_s": 0.02,
            "backoff_max_s": 0.1,
        }
    }


async def test_kube_source_loads_before_start_returns_and_follows_changes(
    fake: FakeApiServer, kubeconfig: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fake.put_slice("vllm-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    pool, metrics = Pool(), Metrics(pool="default")
    sources = EndpointSources(load_config(overrides=kube_config(kubeconfig)), pool, metrics)
    await sources.start()
    try:
        assert sources.name == "kube" and len(pool.ready()) == 2
        fake.put_slice("vllm-a", [terminating("10.0.0.1"), endpoint("10.0.0.2")])
        await async_wait_until(
            lambda: pool.get("10.0.0.1:8000").state is EndpointState.DRAINING,  # type: ignore[union-attr]
            5,
            what="the drain",
        )
        assert (
            b'picker_endpoint_source_events_total{event="relist",source="kube"} 1.0' in metrics.exposition()
        )
    finally:
        with caplog.at_level(logging.ERROR):
            await sources.aclose()
    assert "stopped unexpectedly" not in caplog.text
    await async_wait_until(lambda: fake.live_watches == 0, 5, what="the watch to close")


async def test_kube_source_starts_even_when_the_api_is_not_there_yet(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    fake.put_slice("vllm-a", [endpoint("10.0.0.1")])
    fake.fail_next(3, 503)
    pool = Pool()
    sources = EndpointSources(load_config(overrides=kube_config(kubeconfig)), pool, Metrics(pool="default"))
    await sources.start()
    try:
        assert len(pool) == 0
        await async_wait_until(lambda: len(pool.ready()) == 1, 5, what="the background list")
    finally:
        await sources.aclose()


def test_unreadable_kubeconfig_is_a_config_error(tmp_path: Path) -> None:
    import asyncio

    sources = EndpointSources(
        load_config(overrides=kube_config(tmp_path / "missing")), Pool(), Metrics(pool="default")
    )
    with pytest.raises(ConfigError, match="missing"):
        asyncio.run(sources.start())


async def test_file_source_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 10.0.0.1:8000\n")
    pool = Pool()
    overrides = {"pool": {"endpoints_file": str(path), "endpoints_file_poll_s": 0.02}}
    sources = EndpointSources(load_config(overrides=overrides), pool, Metrics(pool="default"))
    await sources.start()
    try:
        assert sources.name == "file" and [e.address for e in pool.ready()] == ["10.0.0.1:8000"]
        temp = tmp_path / "next.yaml"
        temp.write_text("- {address: 10.0.0.1:8000, draining: true}\n")
        temp.replace(path)
        await async_wait_until(lambda: not pool.ready(), 5, what="the file drain")
    finally:
        await sources.aclose()
    path.write_text("- broken")
    broken = EndpointSources(load_config(overrides=overrides), Pool(), Metrics(pool="default"))
    with pytest.raises(ConfigError, match=r"pool\.endpoints_file: .*entry #0"):
        await broken.start()


async def test_static_list_needs_no_task() -> None:
    pool = Pool()
    sources = EndpointSources(
        load_config(overrides={"pool": {"endpoints": "10.0.0.1:80"}}), pool, Metrics(pool="default")
    )
    await sources.start()
    await sources.aclose()
    assert sources.name == "static" and pool.source == "static" and len(pool.ready()) == 1


async def test_an_unexpected_exit_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def crash(self: EndpointsFile) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(EndpointsFile, "run", crash)
    path = tmp_path / "endpoints.yaml"
    path.write_text("- 10.0.0.1:8000\n")
    sources = EndpointSources(
        load_config(overrides={"pool": {"endpoints_file": str(path)}}), Pool(), Metrics(pool="default")
    )
    with caplog.at_level(logging.ERROR):
        await sources.start()
        await async_wait_until(lambda: "stopped unexpectedly" in caplog.text, 5, what="the log line")
    await sources.aclose()
    assert "RuntimeError: a bug" in caplog.text


async def test_pool_source_loads_its_pods_before_start_returns_and_reports_a_missing_pool(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    fake.put_pool("vllm", ports=(8000, 8001))
    fake.put_pod("vllm-0", "10.0.0.1")
    pool, metrics = Pool(), Metrics(pool="default")
    config = load_config(
        overrides={"kube": {"pool_name": "vllm", "kubeconfig": str(kubeconfig), "backoff_initial_s": 0.02}}
    )
    sources = EndpointSources(config, pool, metrics)
    heard: list[str | None] = []
    sources.on_problem(heard.append)
    await sources.start()
    try:
        assert sources.name == "kube-pool" and sources.problem is None
        assert sorted(e.address for e in pool.ready()) == ["10.0.0.1:8000", "10.0.0.1:8001"]
        fake.delete("inferencepools", "vllm")
        await async_wait_until(lambda: sources.problem is not None, 5, what="the problem")
        assert heard == ["InferencePool default/vllm not found"]
        assert b'event="relist",source="kube-pool"' in metrics.exposition()
    finally:
        await sources.aclose()
    await async_wait_until(lambda: fake.live_watches == 0, 5, what="the watches to close")
