"""The InferencePool source through lightkube against the fake API server: the pool's pods at its
targetPorts, pod states, live selector and port changes, a missing pool, faults, and how early a
deletion is seen compared with the EndpointSlice source."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from loadtest.procs import async_wait_until
from picker.config.model import ConfigError
from picker.config.serve_flags import SERVE_FLAGS, add_serve_flags, overrides
from picker.config.sources import load_config
from picker.pool import EndpointState, Pool
from picker.sources.kube import ApiFailure
from picker.sources.kube_pool import PoolSource
from tests.kube.conftest import PoolSourceFactory, WatcherFactory
from tests.kube.fake_apiserver import FakeApiServer, endpoint

READY, DRAINING, NOT_READY = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY


def view(pool: Pool) -> dict[str, EndpointState]:
    return {e.address: e.state for e in pool.endpoints() if e.state is not EndpointState.GONE}


def seed(fake: FakeApiServer) -> None:
    fake.put_pool("vllm", ports=(8000,))
    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_pod("vllm-1", "10.0.0.2")
    fake.put_pod("other", "10.0.0.9", labels={"app": "other"})


@asynccontextmanager
async def running(source: PoolSource) -> AsyncIterator[None]:
    """First load, then the forever loop, owned (and cancelled) by the test."""
    await source.first_load()
    task = asyncio.create_task(source.run())
    try:
        yield
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def until(pool: Pool, expected: dict[str, EndpointState], what: str) -> None:
    await async_wait_until(lambda: view(pool) == expected, 5, what=what)


async def test_pods_at_each_target_port_and_their_states(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory
) -> None:
    fake.put_pool("vllm", ports=(8000, 8001))
    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_pod("vllm-1", "10.0.0.2", ready=False)
    fake.put_pod("vllm-2", None, phase="Pending")  # not scheduled yet: no IP, nothing to list
    fake.put_pod("vllm-3", "10.0.0.4", phase="Succeeded")  # finished: never serves again
    pool = Pool()
    source = make_pool_source(pool)
    async with running(source):
        assert view(pool) == {
            "10.0.0.1:8000": READY,
            "10.0.0.1:8001": READY,
            "10.0.0.2:8000": NOT_READY,
            "10.0.0.2:8001": NOT_READY,
        }
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="the pool and pod watches")
        fake.put_pod("vllm-0", "10.0.0.1", deleting=True)
        fake.put_pod("vllm-1", "10.0.0.2")
        fake.put_pod("vllm-2", "10.0.0.3", phase="Pending", ready=False)
        await until(
            pool,
            {
                "10.0.0.1:8000": DRAINING,
                "10.0.0.1:8001": DRAINING,
                "10.0.0.2:8000": READY,
                "10.0.0.2:8001": READY,
                "10.0.0.3:8000": NOT_READY,
                "10.0.0.3:8001": NOT_READY,
            },
            "the pod changes",
        )
        assert pool.get("10.0.0.1:8000").drain.source == "kube-pool"  # type: ignore[union-attr]
        fake.delete("pods", "vllm-0")
        await async_wait_until(lambda: "10.0.0.1:8000" not in view(pool), 5, what="the pod gone")
    assert pool.source == "kube-pool"
    (pods_watch,) = fake.watch_requests("pods")
    assert pods_watch["labelSelector"] == "app=vllm" and pods_watch["allowWatchBookmarks"] == "true"
    (pool_watch,) = fake.watch_requests("inferencepools")
    assert pool_watch["fieldSelector"] == "metadata.name=vllm"


async def test_selector_and_target_ports_change_live(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory
) -> None:
    seed(fake)
    fake.put_pod("canary", "10.0.0.5", labels={"app": "vllm-canary"})
    pool = Pool()
    source = make_pool_source(pool)
    async with running(source):
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="the watches")
        fake.put_pool("vllm", ports=(8000, 8002))
        await until(
            pool,
            {a: READY for a in ("10.0.0.1:8000", "10.0.0.1:8002", "10.0.0.2:8000", "10.0.0.2:8002")},
            "the new targetPorts",
        )
        assert source.restarts == 0  # same selector: same pod watch
        fake.put_pool("vllm", selector={"app": "vllm-canary"}, ports=(9000,))
        await until(pool, {"10.0.0.5:9000": READY}, "the new selector")
        assert source.restarts == 1
        await async_wait_until(
            lambda: fake.watch_requests("pods")[-1]["labelSelector"] == "app=vllm-canary", 5, what="rewatch"
        )
        fake.put_pod("canary", "10.0.0.5", labels={"app": "vllm-canary"}, deleting=True)
        await until(pool, {"10.0.0.5:9000": DRAINING}, "a change seen by the new watch")


async def test_missing_or_invalid_pool_is_a_problem_named_once(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake.put_pod("vllm-0", "10.0.0.1")
    problems: list[str | None] = []
    pool = Pool()
    source = make_pool_source(pool, on_problem=problems.append)
    with caplog.at_level(logging.INFO):
        async with running(source):
            assert problems == ["InferencePool default/vllm not found"] and len(pool) == 0
            await async_wait_until(lambda: fake.live_watches == 1, 5, what="the pool watch")
            fake.put_pool("vllm")
            await until(pool, {"10.0.0.1:8000": READY}, "the pool's pods")
            assert problems[-1] is None
            fake.put_pool("vllm", ports=())  # invalid
            await async_wait_until(lambda: len(problems) == 3, 5, what="the invalid pool")
            fake.put_pool("vllm", ports=(), picker="renamed")  # still invalid, same problem
            fake.delete("inferencepools", "vllm")
            await async_wait_until(lambda: len(problems) == 4, 5, what="the deleted pool")
            assert view(pool) == {"10.0.0.1:8000": READY}  # the last good view stays
    assert problems[2] == "InferencePool default/vllm is invalid: spec.targetPorts must list 1 to 8 ports"
    assert problems[3] == "InferencePool default/vllm not found"
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(logged) == 3 and all("InferencePool default/vllm" in line for line in logged)


async def test_pod_watch_faults_converge(fake: FakeApiServer, make_pool_source: PoolSourceFactory) -> None:
    seed(fake)
    pool = Pool()
    source = make_pool_source(pool)
    async with running(source):
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="the watches")
        fake.drop_watches()
        fake.delete("pods", "vllm-1")  # missed, then replayed on resume
        await until(pool, {"10.0.0.1:8000": READY}, "the replayed delete")
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="the resumed watches")
        fake.drop_watches()
        fake.put_pod("vllm-1", "10.0.0.2")
        fake.delete("pods", "vllm-0")
        fake.compact()  # resuming gets 410: relist
        await until(pool, {"10.0.0.2:8000": READY}, "the relisted view")
        await async_wait_until(lambda: fake.live_watches == 2, 5, what="the rewatched")
        fake.inject("{garbage")
        fake.put_pod("vllm-1", "10.0.0.2", deleting=True)
        await until(pool, {"10.0.0.2:8000": DRAINING}, "the view after garbage")
    pod_lists = [r for r in fake.requests if r["path"].endswith("/pods") and "watch" not in r["query"]]
    assert len(pod_lists) == 3  # the first, after the 410, after the garbage


async def test_pod_source_sees_a_deletion_no_later_than_the_slice_source(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory, make_watcher: WatcherFactory
) -> None:
    """Kubernetes sets deletionTimestamp on the pod first; the EndpointSlice controller writes the
    terminating endpoint only after it sees that update. Both sources watch the same API server."""
    seed(fake)
    fake.put_slice("vllm-abc", [endpoint("10.0.0.1"), endpoint("10.0.0.2")], ports=[{"port": 8000}])
    by_pods, by_slices = Pool(), Pool()
    slices = make_watcher(by_slices, target=None)
    await slices.relist()
    slice_task = asyncio.create_task(slices.run())
    try:
        async with running(make_pool_source(by_pods)):
            await async_wait_until(lambda: fake.live_watches == 3, 5, what="three watches")
            assert view(by_pods) == view(by_slices)
            fake.put_pod("vllm-0", "10.0.0.1", deleting=True)  # kubectl delete: the earliest signal
            await async_wait_until(lambda: view(by_pods)["10.0.0.1:8000"] is DRAINING, 5, what="pods")
            assert view(by_slices)["10.0.0.1:8000"] is READY  # the slice says nothing yet
            fake.put_slice(  # the EndpointSlice controller's reaction
                "vllm-abc",
                [endpoint("10.0.0.1", ready=False, terminating=True), endpoint("10.0.0.2")],
                ports=[{"port": 8000}],
            )
            await async_wait_until(lambda: view(by_slices) == view(by_pods), 5, what="the slice source")
    finally:
        slice_task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slice_task


async def test_forbidden_pods_say_which_rbac_rule_is_missing(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory
) -> None:
    fake.put_pool("vllm")
    source = make_pool_source()
    await source.pool_watch.relist()
    assert source.pods is not None
    fake.fail_next(1, 403)
    with pytest.raises(ApiFailure, match=r"get/list/watch on pods \(core\) in namespace default"):
        await source.pods.relist()


def test_pool_flags_reach_the_config() -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--pool-name", "vllm-llama", "--pool-namespace", "models", "--no-objectives"])
    config = load_config(overrides=overrides(args, SERVE_FLAGS))
    assert (config.kube.pool_name, config.kube.namespace, config.kube.objectives) == (
        "vllm-llama",
        "models",
        False,
    )
    assert load_config(overrides={"kube": {"pool_name": "p"}}).kube.objectives is True
    for bad, words in [
        ({"pool_name": "p", "service": "s"}, "kube.service, kube.pool_name"),
        ({"pool_name": "p", "target_port": "8000"}, "the pool's targetPorts"),
        ({"pool_name": "Not_A_Name"}, "kube.pool_name"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(words)):
            load_config(overrides={"kube": bad})
