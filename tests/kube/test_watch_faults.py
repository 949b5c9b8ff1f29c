"""The EndpointSlice source through lightkube against the fake API server: it follows changes, and after
every fault (dropped connection, 410, a delete missed meanwhile, slice recreated, garbage, a silent
connection, the API down) it converges to the API's truth while the pool keeps the last good view."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from loadtest.procs import async_wait_until
from picker.pool import DrainEnd, EndpointState, Pool
from picker.pool.slices import SliceStore, TargetPort
from picker.sources.kube import ApiFailure, SliceWatcher
from picker.sources.kube_api import LightkubeSliceApi, load_kubeconfig
from tests.kube.conftest import FAST, WatcherFactory
from tests.kube.fake_apiserver import FakeApiServer, endpoint, terminating

READY, DRAINING, NOT_READY = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY


def truth(fake: FakeApiServer) -> dict[str, EndpointState]:
    store = SliceStore(TargetPort("http"))
    store.replace(fake.objects())
    return store.desired()


def view(pool: Pool) -> dict[str, EndpointState]:
    return {e.address: e.state for e in pool.endpoints() if e.state is not EndpointState.GONE}


def lists(fake: FakeApiServer) -> int:
    return sum(1 for r in fake.requests if r["query"].get("watch") is None)


def seed(fake: FakeApiServer) -> None:
    fake.put_slice("vllm-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    fake.put_slice("vllm-b", [endpoint("10.0.0.3")])


@asynccontextmanager
async def running(watcher: SliceWatcher) -> AsyncIterator[asyncio.Task[None]]:
    """The watcher's forever loop, owned (and cancelled) by the test."""
    task = asyncio.create_task(watcher.run())
    try:
        yield task
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def converged(fake: FakeApiServer, pool: Pool, within: float = 5.0) -> None:
    await async_wait_until(lambda: view(pool) == truth(fake), within, what="the pool to match the API")


async def test_list_then_watch_follows_a_rolling_drain(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        listed_version = watcher.version
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        lease = pool.lease("10.0.0.1:8000")
        fake.put_slice("vllm-a", [terminating("10.0.0.1"), endpoint("10.0.0.2")])
        await async_wait_until(lambda: view(pool).get("10.0.0.1:8000") is DRAINING, 5, what="drain seen")
        record = pool.get("10.0.0.1:8000").drain  # type: ignore[union-attr]
        assert record is not None and record.in_flight_at_start == 1 and record.source == "kube"
        assert [e.address for e in pool.ready()] == ["10.0.0.2:8000", "10.0.0.3:8000"]
        fake.put_slice("vllm-a", [endpoint("10.0.0.2")])  # the pod is gone
        await converged(fake, pool)
        assert pool.get("10.0.0.1:8000").state is EndpointState.GONE  # type: ignore[union-attr]
        lease.release(DrainEnd.COMPLETED)
        assert pool.get("10.0.0.1:8000") is None and pool.recent_drains()[0].ends[DrainEnd.COMPLETED] == 1
    (first, *_) = fake.watch_requests()
    assert first["resourceVersion"] == listed_version and first["allowWatchBookmarks"] == "true"
    assert first["labelSelector"] == "kubernetes.io/service-name=vllm" and first["timeoutSeconds"] == "30"
    assert lists(fake) == 1


async def test_bookmarks_advance_the_version_to_resume_from(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    watcher = make_watcher()
    async with running(watcher):
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.put_slice("elsewhere", [endpoint("10.9.9.9")], service="other")  # not for this watch
        assert watcher.version != str(fake.resource_version)
        fake.send_bookmarks()
        await async_wait_until(lambda: watcher.version == str(fake.resource_version), 5, what="bookmark")
        fake.drop_watches()
        await async_wait_until(lambda: len(fake.watch_requests()) == 2, 5, what="the resumed watch")
    assert fake.watch_requests()[1]["resourceVersion"] == str(fake.resource_version)


async def test_clean_server_end_resumes_without_relisting(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool, dataclasses.replace(FAST, watch_timeout_s=1))
    async with running(watcher):
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.put_slice("vllm-b", [endpoint("10.0.0.3"), endpoint("10.0.0.4")])
        await async_wait_until(lambda: len(fake.watch_requests()) >= 2, 5, what="a second watch after 1 s")
        await converged(fake, pool)
    assert lists(fake) == 1
    assert fake.watch_requests()[1]["resourceVersion"] == str(fake.resource_version)


async def test_dropped_connection_resumes_and_replays_a_delete_it_missed(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.fail_next(2, 503)  # the API stays unreachable for two more attempts
        assert fake.drop_watches() == 1
        fake.delete_slice("vllm-b")  # never sent on the dropped connection
        assert view(pool)["10.0.0.3:8000"] is READY  # the last good view is still in force
        await converged(fake, pool)
    assert "10.0.0.3:8000" not in view(pool)
    assert lists(fake) == 1  # resumed from its version: the API replayed the delete


@pytest.mark.parametrize("gone_as", ["event", "http"])
async def test_410_relists_and_the_relist_removes_the_ghost(
    fake: FakeApiServer, make_watcher: WatcherFactory, gone_as: str
) -> None:
    fake.gone_as = gone_as
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.drop_watches()
        fake.delete_slice("vllm-b")
        fake.put_slice("vllm-a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False, serving=False)])
        fake.compact()  # the delete is no longer in the history: resuming gets 410
        await converged(fake, pool)
    assert view(pool) == {"10.0.0.1:8000": READY, "10.0.0.2:8000": NOT_READY}
    assert lists(fake) == 2


async def test_slice_deleted_and_recreated_keeps_in_flight_attribution(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        lease = pool.lease("10.0.0.3:8000")
        fake.delete_slice("vllm-b")
        await async_wait_until(lambda: "10.0.0.3:8000" not in view(pool), 5, what="the delete")
        assert pool.get("10.0.0.3:8000").in_flight == 1  # type: ignore[union-attr]  # GONE, still counted
        fake.put_slice("vllm-b", [endpoint("10.0.0.3"), endpoint("10.0.0.5")])
        await converged(fake, pool)
        assert pool.get("10.0.0.3:8000").in_flight == 1  # type: ignore[union-attr]
        lease.release(DrainEnd.COMPLETED)
    assert pool.in_flight() == 0


GARBAGE = [
    "{this is not json",
    '{"type": "MODIFIED", "object": {"metadata": {"name": "vllm-a"}, "endpoints": "nope"}}',
    '{"type": "SURPRISE", "object": {}}',
    '{"type": "ERROR", "object": {"kind": "Status", "code": 500, "message": "etcd hiccup"}}',
]


@pytest.mark.parametrize("raw", GARBAGE, ids=["not-json", "bad-shape", "unknown-type", "error-500"])
async def test_garbage_on_the_watch_keeps_the_last_view_then_converges(
    fake: FakeApiServer, make_watcher: WatcherFactory, raw: str
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.inject(raw)
        fake.put_slice("vllm-b", [terminating("10.0.0.3")])  # after the garbage, on the same stream
        await async_wait_until(lambda: len(fake.watch_requests()) == 2, 5, what="a new watch")
        await converged(fake, pool)
    assert view(pool)["10.0.0.3:8000"] is DRAINING


async def test_silent_connection_hits_the_inactivity_deadline(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool, dataclasses.replace(FAST, inactivity_deadline_s=0.3))
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        assert fake.stall_watches() == 1
        fake.put_slice("vllm-b", [terminating("10.0.0.3")])  # the dead connection never delivers it
        await converged(fake, pool)
    assert lists(fake) == 1 and len(fake.watch_requests()) == 2


async def test_api_down_keeps_routing_on_the_last_view(
    fake: FakeApiServer, make_watcher: WatcherFactory
) -> None:
    seed(fake)
    pool = Pool()
    watcher = make_watcher(pool)
    async with running(watcher):
        await converged(fake, pool)
        await async_wait_until(lambda: fake.live_watches == 1, 5, what="the watch")
        fake.fail_next(1000, 500)
        fake.drop_watches()
        await async_wait_until(lambda: len(fake.requests) >= 8, 5, what="several failed retries")
        assert view(pool) == truth(fake) and len(pool.ready()) == 3
        fake.clear_failures()
        fake.put_slice("vllm-b", [terminating("10.0.0.3")])
        await converged(fake, pool)


async def test_paged_list(fake: FakeApiServer, make_watcher: WatcherFactory) -> None:
    for index in range(5):
        fake.put_slice(f"vllm-{index}", [endpoint(f"10.0.1.{index}")])
    pool = Pool()
    watcher = make_watcher(pool, page_size=2)
    await watcher.relist()
    assert view(pool) == truth(fake) and len(view(pool)) == 5
    assert [r["query"].get("limit") for r in fake.requests] == ["2", "2", "2"]
    assert watcher.version == str(fake.resource_version)


async def test_label_selector_and_port_by_number(fake: FakeApiServer, make_watcher: WatcherFactory) -> None:
    fake.put_slice("x", [endpoint("10.0.0.7")], service=None, labels={"app": "vllm", "tier": "gpu"})
    fake.put_slice("y", [endpoint("10.0.0.8")], service=None, labels={"app": "vllm", "tier": "cpu"})
    pool = Pool()
    await make_watcher(pool, selector="app=vllm,tier=gpu", target="8000").relist()
    assert view(pool) == {"10.0.0.7:8000": READY}


@pytest.mark.parametrize(
    ("code", "words"), [(401, "unauthorized"), (403, "get/list/watch on endpointslices")]
)
async def test_auth_failures_say_what_to_fix(
    fake: FakeApiServer, kubeconfig: Path, code: int, words: str, tmp_path: Path
) -> None:
    config = (
        fake.write_kubeconfig(tmp_path / "wrong", token="wrong-token-0123456789")
        if code == 401
        else kubeconfig
    )
    if code == 403:
        fake.fail_next(1, 403)
    api = LightkubeSliceApi(
        load_kubeconfig(config), selector="a=b", namespace=None, request_timeout_s=5, read_timeout_s=5
    )
    try:
        with pytest.raises(ApiFailure, match=words):
            await api.list_slices()
    finally:
        await api.aclose()


async def test_unreachable_api_is_a_disconnect(tmp_path: Path) -> None:
    from loadtest.procs import free_port
    from picker.sources.kube import Disconnected

    dead = FakeApiServer()
    dead.port = free_port()  # nothing listens there
    api = LightkubeSliceApi(
        load_kubeconfig(dead.write_kubeconfig(tmp_path / "kc")),
        selector="a=b",
        namespace=None,
        request_timeout_s=2,
        read_timeout_s=2,
    )
    try:
        with pytest.raises(Disconnected):
            await api.list_slices()
    finally:
        await api.aclose()


_: Callable[..., object] = SliceWatcher  # the type the factory builds
