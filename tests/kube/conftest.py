"""Fixtures for the Kubernetes sources: the fake API server, a kubeconfig for it, watchers on a pool."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from picker.pool import Pool
from picker.pool.slices import TargetPort
from picker.request.objectives import Objectives
from picker.sources.kube import SliceWatcher, WatchSettings
from picker.sources.kube_api import LightkubePoolApi, LightkubeSliceApi, load_kubeconfig
from picker.sources.kube_pool import PoolSource
from tests.kube.fake_apiserver import FakeApiServer

# Short deadlines so fault recovery takes well under a second; still far above loopback latency.
FAST = WatchSettings(
    watch_timeout_s=30, inactivity_deadline_s=31.0, backoff_initial_s=0.02, backoff_max_s=0.2
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeApiServer]:
    server = await FakeApiServer().start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
def kubeconfig(fake: FakeApiServer, tmp_path: Path) -> Path:
    return fake.write_kubeconfig(tmp_path / "kubeconfig", namespace="default")


WatcherFactory = Callable[..., SliceWatcher]


@pytest.fixture
async def make_watcher(kubeconfig: Path) -> AsyncIterator[WatcherFactory]:
    """Factory: a lightkube-backed watcher feeding a fresh pool (closed after the test)."""
    apis: list[LightkubeSliceApi] = []

    def make(
        pool: Pool | None = None,
        settings: WatchSettings = FAST,
        selector: str = "kubernetes.io/service-name=vllm",
        target: str | None = "http",
        page_size: int = 500,
    ) -> SliceWatcher:
        api = LightkubeSliceApi(
            load_kubeconfig(kubeconfig),
            selector=selector,
            namespace=None,
            request_timeout_s=5.0,
            read_timeout_s=settings.inactivity_deadline_s + 5.0,
            page_size=page_size,
        )
        apis.append(api)
        return SliceWatcher(api, pool if pool is not None else Pool(), TargetPort.parse(target), settings)

    yield make
    for api in apis:
        await api.aclose()


PoolSourceFactory = Callable[..., PoolSource]


@pytest.fixture
async def make_pool_source(kubeconfig: Path) -> AsyncIterator[PoolSourceFactory]:
    """Factory: a lightkube-backed InferencePool source feeding a fresh pool (closed after the test)."""
    apis: list[LightkubePoolApi] = []

    def make(
        pool: Pool | None = None,
        name: str = "vllm",
        settings: WatchSettings = FAST,
        on_problem: Callable[[str | None], None] = lambda _: None,
        objectives: Objectives | None = None,
    ) -> PoolSource:
        api = LightkubePoolApi(
            load_kubeconfig(kubeconfig),
            namespace=None,
            request_timeout_s=5.0,
            read_timeout_s=settings.inactivity_deadline_s + 5.0,
        )
        apis.append(api)
        return PoolSource(
            api,
            pool if pool is not None else Pool(),
            name,
            settings,
            on_problem=on_problem,
            objectives=objectives,
        )

    yield make
    for api in apis:
        await api.aclose()
