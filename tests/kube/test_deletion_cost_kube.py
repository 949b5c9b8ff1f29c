"""kube.deletion_cost on the fake API server: the pool's pods get the pod-deletion-cost annotation, cheapest
first, and nothing else; writes are bounded (none while the ranks hold, a pod at most once per interval,
so many per step); the picker refuses to start without `patch pods`; only the leader writes."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import async_wait_until, free_port
from picker.config.model import ConfigError
from picker.config.sources import load_config
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.deletion_cost import CostPolicy, PodRef, Stream
from picker.pool.deletion_rank import RankPolicy
from picker.sources.deletion_cost import DeletionCostRefused, DeletionCostWriter
from picker.sources.endpoints import EndpointSources
from picker.sources.kube_api import load_kubeconfig
from picker.sources.lease import Election, Elector
from picker.sources.lease_api import LightkubeLeaseApi
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.fake_patch import DELETION_COST

PODS = {f"vllm-{i}": f"10.0.0.{i + 1}" for i in range(4)}
COST = CostPolicy(unknown_tokens=100, time_per_token_s=0.05, work_weight=0.1, cache_s=0.0)
RANK = RankPolicy(interval_s=10.0, margin_s=1.0, margin_ratio=0.25, max_writes=20)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def streams_with(tokens_left: dict[str, int]) -> list[Stream]:
    """One stream per pod with that many tokens left (0: an idle pod), at the default pace."""
    return [Stream(f"{PODS[name]}:8000", 10 + left, 10, None) for name, left in tokens_left.items() if left]


def config_of(kubeconfig: Path, **kube: Any) -> Any:
    return load_config(
        overrides={
            "kube": {
                "pool_name": "vllm",
                "kubeconfig": str(kubeconfig),
                "deletion_cost": True,
                "backoff_initial_s": 0.02,
                "backoff_max_s": 0.1,
                **kube,
            }
        }
    )


@pytest.fixture
def pool_pods(fake: FakeApiServer) -> FakeApiServer:
    fake.put_pool("vllm")
    for name, ip in PODS.items():
        fake.put_pod(name, ip, labels={"app": "vllm", "pod-template-hash": "abc"})
    return fake


@pytest.fixture
async def open_sources(kubeconfig: Path) -> AsyncIterator[Callable[..., Any]]:
    opened: list[EndpointSources] = []

    async def start(path: Path = kubeconfig, **kube: Any) -> EndpointSources:
        sources = EndpointSources(config_of(path, **kube), Pool(), Metrics(pool="default"))
        await sources.start()
        opened.append(sources)
        return sources

    yield start
    for sources in opened:
        await sources.aclose()


def writer(
    sources: EndpointSources, streams: list[Stream], clock: Clock, **options: Any
) -> DeletionCostWriter:
    assert sources.pod_patcher is not None
    return DeletionCostWriter(
        sources.pod_patcher,
        sources.pod_refs,
        lambda: streams,
        Pool(),
        COST,
        options.pop("rank", RANK),
        step_s=1.0,
        clock=clock,
        **options,
    )


def annotations(fake: FakeApiServer) -> dict[str, str | None]:
    return {
        pod["metadata"]["name"]: (pod["metadata"].get("annotations") or {}).get(DELETION_COST)
        for pod in fake.objects(selector="", resource="pods")
    }


async def test_each_pod_gets_its_rank_cheapest_first_and_nothing_else_changes(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    before = {p["metadata"]["name"]: p for p in fake.objects(selector="", resource="pods")}
    sources = await open_sources()
    streams = streams_with({"vllm-0": 400, "vllm-1": 0, "vllm-2": 2000, "vllm-3": 40})
    assert await writer(sources, streams, Clock()).step() == 4
    assert annotations(fake) == {"vllm-0": "2000", "vllm-1": "0", "vllm-2": "3000", "vllm-3": "1000"}
    for name, pod in {p["metadata"]["name"]: p for p in fake.objects(selector="", resource="pods")}.items():
        assert pod["metadata"]["labels"] == before[name]["metadata"]["labels"]  # untouched
        assert pod["spec"] == before[name]["spec"] and pod["status"] == before[name]["status"]
        assert set(pod["metadata"]["annotations"]) == {DELETION_COST}
    for body in (p["body"] for p in fake.patches):  # a merge patch of that annotation, with the uid
        assert set(body) == {"metadata"} and set(body["metadata"]) == {"annotations", "uid"}
        assert set(body["metadata"]["annotations"]) == {DELETION_COST}
    patches = [r for r in fake.requests if "/pods/" in r["path"]]
    assert {r["method"] for r in patches} == {"PATCH"}
    assert all(r["query"] == {"fieldManager": "inference-picker"} for r in patches)


async def test_writes_are_bounded_by_the_ranks_the_interval_and_the_step(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    sources = await open_sources()
    clock = Clock()
    streams = streams_with({"vllm-0": 400, "vllm-1": 0, "vllm-2": 2000, "vllm-3": 40})
    cost = writer(sources, streams, clock)
    await cost.step()
    await async_wait_until(lambda: all(p.value is not None for p in sources.pod_refs()), 5, what="the watch")
    written = len(fake.patches)
    for wiggle in (1.1, 0.9, 1.05):  # the figures move, the ranks hold: nothing is written
        clock.now += 30
        streams[:] = [Stream(s.endpoint, 10 + round((s.asked - 10) * wiggle), 10, None) for s in streams]  # type: ignore[operator]
        assert await cost.step() == 0
    assert len(fake.patches) == written
    clock.now += 30
    streams[:] = streams_with({"vllm-0": 400, "vllm-1": 3000, "vllm-2": 2000, "vllm-3": 40})
    assert await cost.step() == 1  # vllm-1 is now the dearest: it alone moves
    assert annotations(fake)["vllm-1"] == "4000"
    clock.now += 4  # within the interval: vllm-1 may not change again yet
    streams[:] = streams_with({"vllm-0": 400, "vllm-1": 0, "vllm-2": 2000, "vllm-3": 40})
    assert await cost.step() == 0 and cost.skipped["interval"] == 1
    clock.now += 6
    assert await cost.step() == 1
    values = {name: int(value or 0) for name, value in annotations(fake).items()}
    assert sorted(values, key=values.__getitem__) == ["vllm-1", "vllm-3", "vllm-0", "vllm-2"]
    few = writer(sources, streams, clock, rank=RankPolicy(10.0, 1.0, 0.25, max_writes=1))
    fake.put_pod("vllm-4", "10.0.0.5")  # two new pods
    fake.put_pod("vllm-5", "10.0.0.6")
    await async_wait_until(lambda: len(sources.pod_refs()) == 6, 5, what="the new pods")
    assert await few.step() == 1 and few.skipped["bound"] >= 1


async def test_a_gone_pod_and_a_failing_api_server_cost_a_step_not_the_writer(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    sources = await open_sources()
    assert sources.pod_patcher is not None
    # vllm-0 as a source that has not yet seen it replaced: its name is another pod's now
    stale = [
        replace(p, uid="uid-of-a-pod-long-gone") if p.name == "vllm-0" else p for p in sources.pod_refs()
    ]
    cost = DeletionCostWriter(
        sources.pod_patcher, lambda: stale, lambda: [], Pool(), COST, RANK, step_s=1.0, clock=Clock()
    )
    fake.fail_next(1, 500, resource="pods")
    assert await cost.step() == 0 and cost.writes == {"failed": 1}  # the rest waits for the next step
    assert await cost.step() == 3 and cost.writes == {"failed": 1, "gone": 1, "written": 3}
    assert annotations(fake)["vllm-0"] is None  # the uid precondition kept it off the successor
    assert [p["status"] for p in fake.patches if p["name"] == "vllm-0"] == [500, 409]


async def test_a_write_that_went_through_counts_whatever_the_answer_holds(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    """The API server answers a PATCH with the whole pod; a field the client library's model refuses
    (here a container status without `image`) must not make a write that went through look failed,
    and be made again at every step."""
    fake = pool_pods
    sources = await open_sources()  # the pods as an EndpointSlice source names them: never decoded
    assert sources.pod_patcher is not None
    refs = sources.pod_refs()
    for name, ip in PODS.items():
        pod = fake.put_pod(name, ip)
        pod["status"]["containerStatuses"] = [{"name": "vllm", "ready": True, "restartCount": 0}]
    refs = [PodRef(p.namespace, p.name, p.addresses) for p in refs]
    cost = DeletionCostWriter(
        sources.pod_patcher, lambda: refs, lambda: [], Pool(), COST, RANK, step_s=1.0, clock=Clock()
    )
    assert await cost.step() == 4 and cost.writes == {"written": 4}
    assert await cost.step() == 0
    assert len(fake.patches) == 4


async def test_the_picker_refuses_to_start_without_patch_on_pods(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any], kubeconfig: Path
) -> None:
    fake = pool_pods
    fake.rbac()
    sources = EndpointSources(config_of(kubeconfig), Pool(), Metrics(pool="default"))
    with pytest.raises(DeletionCostRefused, match=r"may not patch pods in namespace default") as refused:
        await sources.start()
    assert isinstance(refused.value, ConfigError)
    await sources.aclose()
    assert fake.self_reviews == [
        {"resourceAttributes": {"group": "", "namespace": "default", "resource": "pods", "verb": "patch"}}
    ]
    fake.grant_resource(fake.user_of(fake.token), "patch", "pods")
    allowed = await open_sources()
    assert allowed.pod_patcher is not None and allowed.patch_allowed


async def test_an_unanswered_review_starts_and_writes_nothing_until_allowed(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    fake.rbac()
    fake.fail_next(1, 503, resource="selfsubjectaccessreviews")
    sources = await open_sources()
    assert not sources.patch_allowed
    cost = writer(sources, streams_with({"vllm-2": 2000}), Clock(), allowed=False)
    assert await cost.step() == 0 and fake.patches == []  # asked again: not allowed
    fake.grant_resource(fake.user_of(fake.token), "patch", "pods")
    assert await cost.step() == 4


async def test_a_review_the_api_server_does_not_serve_leaves_the_answer_to_the_patches(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    """A 404 from SelfSubjectAccessReview (not served there, or by a proxy in front) is no refusal:
    the picker starts, never asks again, and tries the patches; one answered 403 is counted
    (`forbidden`) and holds the writes back for a while, not every step; once granted, it writes."""
    fake = pool_pods
    fake.rbac()
    fake.fail_next(1, 404, resource="selfsubjectaccessreviews")
    sources = await open_sources()
    assert sources.patch_allowed  # unknown: the patches will say
    clock = Clock()
    cost = writer(sources, streams_with({"vllm-2": 2000}), clock, allowed=sources.patch_allowed)
    assert await cost.step() == 0
    assert [p["status"] for p in fake.patches] == [403] and cost.writes == {"forbidden": 1}
    clock.now += 1.0
    assert await cost.step() == 0 and len(fake.patches) == 1  # held back: not a patch a step
    assert cost.skipped["forbidden"] == 1
    fake.grant_resource(fake.user_of(fake.token), "patch", "pods")
    clock.now += 60.0
    assert await cost.step() == 4
    assert fake.self_reviews == []  # the review was asked once, at start, and never again


class Replica:
    """One picker of two: its own client for the pods, the Lease and the patches."""

    def __init__(self, fake: FakeApiServer, tmp_path: Path, name: str) -> None:
        self.kubeconfig = fake.write_kubeconfig(
            tmp_path / f"kc-{name}", token=fake.add_token(f"token-{name}")
        )
        self.api = LightkubeLeaseApi(
            load_kubeconfig(self.kubeconfig), "vllm-picker-leader", namespace=None, request_timeout_s=5.0
        )
        self.election = Election(self.api, Elector(name, 1.0, 0.6), 0.05, lambda _: None)


async def test_only_the_leader_writes_and_a_new_leader_carries_on_from_the_pods(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any], tmp_path: Path
) -> None:
    fake = pool_pods
    a, b = Replica(fake, tmp_path, "a"), Replica(fake, tmp_path, "b")
    try:
        streams = streams_with({"vllm-0": 400, "vllm-1": 0, "vllm-2": 2000, "vllm-3": 40})
        writers = {}
        for replica in (a, b):
            sources = await open_sources(replica.kubeconfig)
            elector = replica.election.elector
            writers[replica] = (
                sources,
                writer(sources, streams, Clock(), writing=lambda e=elector: e.leading),
            )
        await a.election.step()
        await b.election.step()
        assert a.election.elector.leading and not b.election.elector.leading
        assert await writers[b][1].step() == 0 and writers[b][1].skipped["standby"] == 1
        assert await writers[a][1].step() == 4
        patched_by = {p["name"] for p in fake.patches}
        assert len(patched_by) == 4
        await a.election.release()
        await b.election.step()
        assert b.election.elector.leading
        b_sources = writers[b][0]
        await async_wait_until(
            lambda: all(p.value is not None for p in b_sources.pod_refs()), 5, what="b's watch"
        )
        assert await writers[a][1].step() == 0  # stood down
        assert await writers[b][1].step() == 0  # the ranks hold: the pods already say them
        assert len(fake.patches) == 4
    finally:
        for replica in (a, b):
            await replica.api.aclose()


async def test_picker_proxy_exits_at_start_without_the_grant(
    pool_pods: FakeApiServer, kubeconfig: Path, tmp_path: Path
) -> None:
    """The whole process: `picker proxy --pod-deletion-cost` ends at start, saying what it needs."""
    pool_pods.rbac()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1",
        "--port", str(free_port()), "--metrics-port", str(free_port()),
        "--pool-name", "vllm", "--kubeconfig", str(kubeconfig), "--pod-deletion-cost",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode not in (0, None)
    assert b"may not patch pods in namespace default" in output
    assert pool_pods.patches == [] and len(pool_pods.self_reviews) == 1
