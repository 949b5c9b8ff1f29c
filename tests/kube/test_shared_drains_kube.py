"""Admin drains shared through one ConfigMap on the fake API server: two picker replicas (two pools, two
clients, two list/watch loops), a drain through either applies on both; the record outlives the
source's updates, is created when missing, survives write conflicts, and reports an API outage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from loadtest import http_client
from picker.app import PickerApp
from picker.config.model import PickerConfig
from picker.config.sources import load_config
from picker.pool import EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.sources.drain_causes import OPERATOR, PRESTOP, CauseKind, rollback
from picker.sources.drain_store import DrainRecordUnavailable
from picker.sources.kube_api import load_kubeconfig
from picker.sources.kube_drains import DATA_KEY, ConfigMapDrains
from picker.sources.kube_drains_api import LightkubeDrainRecordApi
from tests.kube.conftest import FAST
from tests.kube.fake_apiserver import FakeApiServer

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
NAME = "vllm-llama-picker-drains"
WAIT_S = 5.0  # every replica applies a change within 1 s; a broken one never does


class Replica:
    """One picker replica's drain store over its own pool, client and watch."""

    def __init__(self, kubeconfig: Path, endpoints: list[str]) -> None:
        self.pool = Pool()
        self.pool.apply(ready=endpoints, source="kube")
        self.api = LightkubeDrainRecordApi(
            load_kubeconfig(kubeconfig), NAME, namespace=None, request_timeout_s=5.0, read_timeout_s=40.0
        )
        self.drains = ConfigMapDrains(self.api, self.pool, FAST)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> Replica:
        await self.drains.watch.relist()
        self.task = asyncio.create_task(self.drains.watch.run())
        return self

    def state(self, address: str) -> EndpointState | None:
        endpoint = self.pool.get(address)
        return None if endpoint is None else endpoint.state

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        await self.api.aclose()


@pytest.fixture
async def replicas(kubeconfig: Path) -> AsyncIterator[Callable[..., Replica]]:
    made: list[Replica] = []

    def make(endpoints: list[str] = [A, B]) -> Replica:  # noqa: B006 (never mutated)
        replica = Replica(kubeconfig, endpoints)
        made.append(replica)
        return replica

    yield make
    for replica in made:
        await replica.close()


async def until(condition: Callable[[], bool]) -> float:
    """Seconds until `condition` held (a poll with a deadline)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110 (the pools have no change event to wait on here)
            await asyncio.sleep(0.01)
    return loop.time() - started


def recorded(fake: FakeApiServer) -> list[str]:
    (obj,) = [o for o in fake.objects(selector="", resource="configmaps") if o["metadata"]["name"] == NAME]
    return list(json.loads(obj["data"][DATA_KEY]))


async def test_drain_through_one_replica_applies_on_the_other(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first, second = await replicas().start(), await replicas().start()
    endpoint = await first.drains.drain(A)  # creates the ConfigMap
    assert endpoint.state is EndpointState.DRAINING
    assert recorded(fake) == [A]
    took = await until(lambda: second.state(A) is EndpointState.DRAINING)
    assert took < 1.0 or pytest.fail(f"applied after {took:.2f} s")
    assert second.pool.admin_drained(A)
    await second.drains.undrain(A)
    assert recorded(fake) == []
    await until(lambda: first.state(A) is EndpointState.READY)
    assert second.state(A) is EndpointState.READY


async def test_the_record_outlives_source_updates_and_reaches_late_endpoints(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first = await replicas().start()
    late = await replicas([B]).start()  # its source does not list A yet
    await first.drains.drain(A)
    await until(lambda: A in late.drains.record.drained)
    late.pool.apply(ready=[A, B], source="kube")  # the source catches up: A arrives drained
    assert late.state(A) is EndpointState.DRAINING
    first.pool.apply(ready=[B], source="kube")  # A leaves the source, then returns
    first.pool.apply(ready=[A, B], source="kube")
    assert first.state(A) is EndpointState.DRAINING


async def test_concurrent_drains_through_both_replicas_are_both_recorded(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first, second = await replicas().start(), await replicas().start()
    await asyncio.gather(first.drains.drain(A), second.drains.drain(B))  # one of them gets a 409
    assert sorted(recorded(fake)) == [A, B]
    await until(
        lambda: first.state(B) is EndpointState.DRAINING and second.state(A) is EndpointState.DRAINING
    )


async def test_conflicts_and_unknown_addresses(fake: FakeApiServer, replicas: Callable[..., Replica]) -> None:
    replica = await replicas().start()
    with pytest.raises(UnknownEndpoint):
        await replica.drains.drain("10.9.9.9:8000")
    with pytest.raises(EndpointConflict):
        await replica.drains.undrain(A)  # not drained
    assert fake.objects(selector="", resource="configmaps") == []


async def test_an_api_outage_is_reported_not_hidden(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    replica = await replicas().start()
    fake.fail_next(1, 503, resource="configmaps")
    with pytest.raises(DrainRecordUnavailable):
        await replica.drains.drain(A)
    assert replica.state(A) is EndpointState.READY  # nothing recorded, nothing applied


def apps_config(kubeconfig: Path, configmap: str = NAME, **more: object) -> PickerConfig:
    """A PickerApp on pool `vllm` sharing its drains through `configmap`, on ports of its own."""
    return load_config(
        overrides={
            "server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False},
            "kube": {
                "pool_name": "vllm",
                "kubeconfig": str(kubeconfig),
                "backoff_initial_s": 0.02,
                "drains_configmap": configmap,
            },
            "load": {"scrape": False},
            **more,
        }
    )


async def test_two_picker_apps_share_admin_drains(fake: FakeApiServer, kubeconfig: Path) -> None:
    """The wiring: `kube.drains_configmap` makes each PickerApp's admin API write the ConfigMap."""
    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_pod("vllm-1", "10.0.0.2")
    fake.put_pool("vllm")
    config = apps_config(kubeconfig)
    first, second = PickerApp(config), PickerApp(config)
    first_ports = await first.start()
    try:
        await second.start()
        try:
            url = f"http://127.0.0.1:{first_ports.metrics}/admin/endpoints/{A}/drain"
            async with http_client.AsyncClient() as client:
                response = await client.post(url, timeout=5)
            assert response.status_code == 200, response.text
            await until(lambda: second.pool.get(A) is not None and second.pool.admin_drained(A))
            assert second.pool.get(A).state is EndpointState.DRAINING  # type: ignore[union-attr]
            assert recorded(fake) == [A]
        finally:
            await second.stop()
    finally:
        await first.stop()


def listed(replica: Replica, pods: dict[str, str]) -> None:
    """The replica's source lists these addresses, ready, each with its pod's uid."""
    replica.pool.reconcile(dict.fromkeys(pods, EndpointState.READY), "kube-pods", instances=pods)


async def test_a_rollback_drain_is_the_pods_and_ends_with_it(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    """Issue 40, item 8: rollback drains recorded by IP drained, silently, a later pod given a former
    candidate's IP. A drain with `pod` holds that pod only, and is cleared once it is gone."""
    first, second = await replicas().start(), await replicas().start()
    for replica in (first, second):
        listed(replica, {A: "uid-a", B: "uid-b"})
    await first.drains.drain(A, pod="uid-a")
    assert recorded(fake) == [{"address": A, "pod": "uid-a"}]
    await until(lambda: second.state(A) is EndpointState.DRAINING)
    listed(second, {A: "uid-new", B: "uid-b"})  # the candidate's pod went; a new pod got its IP
    assert second.state(A) is EndpointState.READY
    await until(lambda: recorded(fake) == [])  # cleared from the record by the replica that saw it
    listed(first, {A: "uid-new", B: "uid-b"})
    await until(lambda: first.state(A) is EndpointState.READY)


async def test_an_operators_drain_stays_the_addresses_and_undrain_lifts_both(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first = await replicas().start()
    listed(first, {A: "uid-a", B: "uid-b"})
    await first.drains.drain(A, pod="uid-a")
    await first.drains.drain(A)  # the operator's, by address
    listed(first, {A: "uid-new", B: "uid-b"})
    assert first.state(A) is EndpointState.DRAINING  # the address's drain holds the new pod
    await until(lambda: recorded(fake) == [A])  # the pod's drain is cleared, the address's stays
    await first.drains.undrain(A)
    assert recorded(fake) == [] and first.state(A) is EndpointState.READY


async def test_a_pods_drain_is_cleared_when_its_address_leaves_the_source(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first = await replicas().start()
    listed(first, {A: "uid-a", B: "uid-b"})
    await first.drains.drain(A, pod="uid-a")
    listed(first, {B: "uid-b"})  # the pod is deleted; no request was running on it
    await until(lambda: recorded(fake) == [])


async def test_the_guard_judges_against_the_record_it_replaces_across_pickers(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    """Issue 40, item 6: two pickers' guards each judged on their own view, so drains through two
    pickers at once both passed. The check runs inside the conditional write: one of them sees
    the other's drain in the record it would replace, and is refused."""
    from picker.sources.drain_store import DrainRefused

    first, second = await replicas().start(), await replicas().start()

    def one_at_most(drained_elsewhere: frozenset[str]) -> None:
        if drained_elsewhere:  # the pool cannot spare two
            raise DrainRefused("would leave too little", {"drained": sorted(drained_elsewhere)})

    results = await asyncio.gather(
        first.drains.drain(A, check=one_at_most),
        second.drains.drain(B, check=one_at_most),
        return_exceptions=True,
    )
    refused = [r for r in results if isinstance(r, DrainRefused)]
    assert len(refused) == 1, results
    assert len(recorded(fake)) == 1


async def test_old_records_read_as_the_operators_and_a_malformed_item_is_counted_not_applied(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    """Issue 53, item 5: items older than causes (an address; an {address, pod}) are the
    operator's; an item that does not validate whole (an unknown cause, a rollback without its
    rollout, a bad address) is not applied, counted once, and kept when a picker rewrites the record."""
    C = "10.0.0.3:8000"
    bad = [
        {"address": A, "cause": "autoscaler"},
        {"address": B, "cause": "rollback"},
        {"address": C, "cause": "prestop", "rollout": "x"},
        {"address": "nonsense"},
        ["not", "an", "item"],
    ]
    items = [A, {"address": B, "pod": "uid-b"}, *bad]
    fake.put("configmaps", NAME, {"data": {DATA_KEY: json.dumps(items)}}, labels={})
    replica = replicas([A, B, C])
    listed(replica, {A: "uid-a", B: "uid-b", C: "uid-c"})  # its source knows pods before the record
    await replica.start()
    await until(lambda: replica.state(B) is EndpointState.DRAINING)
    assert replica.state(A) is EndpointState.DRAINING and replica.state(C) is EndpointState.READY
    assert replica.drains.drained_by() == {A: [OPERATOR], B: [OPERATOR]}
    expected = {"unknown-cause": 1, "bad-rollout": 2, "bad-address": 1, "bad-item": 1}
    assert dict(replica.drains.rejected) == expected
    await replica.drains.drain(C, cause=PRESTOP)  # a rewrite: what it cannot read stays as it was
    assert recorded(fake) == [
        A,
        {"address": B, "pod": "uid-b"},
        {"address": C, "cause": "prestop"},
        *[json.loads(json.dumps(item, sort_keys=True)) for item in bad],
    ]
    await until(lambda: replica.state(C) is EndpointState.DRAINING)
    assert dict(replica.drains.rejected) == expected  # read again: not counted again
    lifted = await replica.drains.undrain(B)  # the operator's: by address, whatever pod runs there
    assert lifted.causes == (OPERATOR,) and replica.state(B) is EndpointState.READY


async def test_drains_of_several_causes_hold_one_address_until_the_last_is_lifted(
    fake: FakeApiServer, replicas: Callable[..., Replica]
) -> None:
    first, second = await replicas().start(), await replicas().start()
    for replica in (first, second):
        listed(replica, {A: "uid-a", B: "uid-b"})
    mine = rollback("app.kubernetes.io/version=v2")
    await first.drains.drain(A, cause=mine, pod="uid-a")
    await first.drains.drain(B, cause=mine, pod="uid-b")
    await second.drains.drain(A, cause=PRESTOP)
    await second.drains.drain(A)
    assert sorted(recorded(fake), key=json.dumps) == sorted(
        [
            A,
            {"address": A, "cause": "prestop"},
            {"address": A, "cause": "rollback", "rollout": "app.kubernetes.io/version=v2", "pod": "uid-a"},
            {"address": B, "cause": "rollback", "rollout": "app.kubernetes.io/version=v2", "pod": "uid-b"},
        ],
        key=json.dumps,
    )
    await until(lambda: len(first.drains.drained_by().get(A, [])) == 3)
    assert await second.drains.lift(mine) == [A, B]  # every drain of that cause, in one write
    await until(lambda: first.state(B) is EndpointState.READY)
    assert first.state(A) is EndpointState.DRAINING
    with pytest.raises(EndpointConflict, match="holds no rollback drain"):
        await first.drains.undrain(A, only=CauseKind.ROLLBACK)
    assert (await first.drains.undrain(A, only=CauseKind.PRESTOP)).causes == (PRESTOP,)
    assert first.state(A) is EndpointState.DRAINING  # the operator's holds
    assert recorded(fake) == [A]
