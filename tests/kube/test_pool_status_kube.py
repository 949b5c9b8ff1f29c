"""kube.pool_status on the fake API server: the InferencePool's `Ready` condition (the picker's own
entry in status.parents) says Ready at start, turns False within 2 s of the last ready endpoint
draining, True again as one returns, Stopping at shutdown; a gateway's entry is kept; writes are
bounded; events on changes of state and drains; only the writer writes; without a grant the picker
refuses to start, and with the events grant alone it records events and leaves the status alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from loadtest.procs import async_wait_until
from picker.config.model import ConfigError
from picker.config.sources import load_config
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.sources.endpoints import EndpointSources
from picker.sources.pool_status import PoolStatusRefused, PoolStatusWriter
from tests.kube.fake_apiserver import FakeApiServer

GATEWAY = {
    "parentRef": {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway"},
    "conditions": [
        {
            "type": "Accepted",
            "status": "True",
            "reason": "Accepted",
            "message": "",
            "lastTransitionTime": "2026-01-01T00:00:00Z",
            "observedGeneration": 1,
        }
    ],
}
PICKER_REF = {"group": "", "kind": "Service", "name": "inference-picker", "namespace": "default"}


def config_of(kubeconfig: Path) -> Any:
    return load_config(
        overrides={
            "kube": {
                "pool_name": "vllm",
                "kubeconfig": str(kubeconfig),
                "pool_status": True,
                "backoff_initial_s": 0.02,
                "backoff_max_s": 0.1,
            }
        }
    )


@pytest.fixture
def pool_pods(fake: FakeApiServer) -> FakeApiServer:
    fake.put_pool("vllm")["status"] = {"parents": [GATEWAY]}  # as the gateway's controller wrote it
    for i in range(2):
        fake.put_pod(f"vllm-{i}", f"10.0.0.{i + 1}")
    return fake


@pytest.fixture
async def open_sources(kubeconfig: Path) -> AsyncIterator[Callable[..., Any]]:
    opened: list[EndpointSources] = []

    async def start(path: Path = kubeconfig) -> EndpointSources:
        sources = EndpointSources(config_of(path), Pool(), Metrics(pool="default"))
        opened.append(sources)
        await sources.start()
        return sources

    yield start
    for sources in opened:
        await sources.aclose()


def writer(sources: EndpointSources, **options: Any) -> PoolStatusWriter:
    assert sources.status_api is not None
    return PoolStatusWriter(
        sources.status_api,
        sources._pool,
        "vllm",
        identity="picker-a",
        debounce_s=config_of(Path("unused")).kube.pool_status_debounce_s,  # the shipped default
        resync_s=30.0,
        grants=sources.status_grants,
        problem=lambda: sources.problem,
        **options,
    )


def parents(fake: FakeApiServer) -> list[dict[str, Any]]:
    pool = fake.objects(selector="", resource="inferencepools")[0]
    return list((pool.get("status") or {}).get("parents") or [])


def ready(fake: FakeApiServer) -> dict[str, Any] | None:
    """The picker's Ready condition as the pool shows it now."""
    ours = [p for p in parents(fake) if p["parentRef"] == PICKER_REF]
    assert len(ours) <= 1
    return ours[0]["conditions"][0] if ours else None


def shows(fake: FakeApiServer, status: str, reason: str) -> Callable[[], bool]:
    def check() -> bool:
        condition = ready(fake)
        return condition is not None and (condition["status"], condition["reason"]) == (status, reason)

    return check


def status_patches(fake: FakeApiServer) -> list[dict[str, Any]]:
    return [p for p in fake.patches if p["subresource"] == "status"]


async def test_degraded_within_2_s_of_the_last_ready_endpoint_draining_and_ready_again(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    sources = await open_sources()
    status = writer(sources)
    task = asyncio.create_task(status.run())
    try:
        await async_wait_until(shows(fake, "True", "Ready"), 5, what="Ready at start")
        condition = ready(fake)
        assert condition is not None and condition["type"] == "Ready" and condition["observedGeneration"] == 1
        assert parents(fake)[0] == GATEWAY  # the gateway's entry, untouched and first
        fake.put_pod("vllm-0", "10.0.0.1", deleting=True)
        await async_wait_until(lambda: len(sources._pool.ready()) == 1, 5, what="the first drain seen")
        drained_at = time.monotonic()
        fake.put_pod("vllm-1", "10.0.0.2", deleting=True)  # the last ready endpoint drains
        await async_wait_until(shows(fake, "False", "AllDraining"), 2.0, what="Degraded within 2 s")
        degraded_s = time.monotonic() - drained_at
        print(f"time to degraded: {degraded_s:.3f} s")
        assert degraded_s < 2.0
        assert "every endpoint is draining (0 of 2 endpoints ready, 2 draining)" in ready(fake)["message"]  # type: ignore[index]
        returned_at = time.monotonic()
        fake.put_pod("vllm-2", "10.0.0.3")  # a new one comes up
        await async_wait_until(shows(fake, "True", "Ready"), 2.0, what="Ready again within 2 s")
        print(f"time to ready again: {time.monotonic() - returned_at:.3f} s")
        await async_wait_until(lambda: fake.event_reasons().count("PoolReady") == 2, 2.0, what="events")
        assert fake.event_reasons() == [
            "PoolReady", "EndpointDraining", "EndpointDraining", "PoolDegraded", "PoolReady",
        ]  # fmt: skip
        notes = [e["note"] for e in fake.events if e["reason"] == "EndpointDraining"]
        assert notes[0].startswith("endpoint 10.0.0.1:8000 draining (cause source")
        uid = fake.objects(selector="", resource="inferencepools")[0]["metadata"]["uid"]
        assert uid and all(
            e["regarding"]["name"] == "vllm"
            and e["regarding"]["uid"] == uid
            and e["reportingInstance"] == "picker-a"
            for e in fake.events
        )
        assert len(status_patches(fake)) == 3  # Ready, Degraded, Ready: one write per change of state
        assert parents(fake)[0] == GATEWAY and len(parents(fake)) == 2
        await status.stopping(5.0)  # shutdown
        assert shows(fake, "False", "Stopping")() and fake.event_reasons()[-1] == "PickerStopping"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_writes_are_bounded_and_a_lost_entry_comes_back_at_the_resync(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    sources = await open_sources()
    status = writer(sources)
    assert await status.step() and len(status_patches(fake)) == 1
    fake.put_pod("vllm-2", "10.0.0.3")  # the pool changes, its state holds
    fake.put_pod("vllm-0", "10.0.0.1", deleting=True)
    await async_wait_until(lambda: len(sources._pool.endpoints()) == 3, 5, what="the changes seen")
    for _ in range(3):
        assert not await status.step()
    assert len(status_patches(fake)) == 1 and status.writes == {"written": 1}
    assert not await status.step(resync=True)  # a re-read: the entry says it already, nothing written
    assert status.writes == {"written": 1, "unchanged": 1}
    fake.put_pool("vllm")["status"] = {"parents": [GATEWAY]}  # a controller dropped the picker's entry
    assert await status.step(resync=True) and shows(fake, "True", "Ready")()
    assert len(status_patches(fake)) == 2 and parents(fake)[0] == GATEWAY


async def test_a_write_raced_by_a_controller_keeps_its_entry(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    fake = pool_pods
    sources = await open_sources()
    assert sources.status_api is not None
    parents_read, version, *_ = await sources.status_api.read("vllm")
    fake.put_pool("vllm", ports=(8000, 8001))  # written meanwhile
    from picker.sources.pool_status.api import StatusConflict

    with pytest.raises(StatusConflict):
        await sources.status_api.write("vllm", [*parents_read], version)
    status = writer(sources)
    assert await status.step()
    assert [p["parentRef"]["name"] for p in parents(fake)] == ["inference-gateway", "inference-picker"]


async def test_only_the_writer_writes(pool_pods: FakeApiServer, open_sources: Callable[..., Any]) -> None:
    fake = pool_pods
    sources = await open_sources()
    leading = False
    status = writer(sources, writing=lambda: leading)
    fake.put_pod("vllm-0", "10.0.0.1", deleting=True)
    await async_wait_until(lambda: len(sources._pool.ready()) == 1, 5, what="the drain seen")
    assert not await status.step() and status.skipped["standby"] == 1
    assert status_patches(fake) == [] and fake.events == []
    leading = True  # it takes over: the state, but not the drain it saw while standing by
    assert await status.step()
    assert fake.event_reasons() == ["PoolReady"] and len(status_patches(fake)) == 1


async def test_the_picker_refuses_to_start_with_no_grant_and_with_events_alone_writes_no_status(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any], kubeconfig: Path
) -> None:
    fake = pool_pods
    fake.rbac()
    refused = EndpointSources(config_of(kubeconfig), Pool(), Metrics(pool="default"))
    with pytest.raises(PoolStatusRefused, match=r"may neither patch inferencepools/status nor create events"):
        await refused.start()
    await refused.aclose()
    assert isinstance(PoolStatusRefused("x"), ConfigError)
    assert fake.self_reviews == [
        {
            "resourceAttributes": {
                "group": "inference.networking.k8s.io",
                "namespace": "default",
                "resource": "inferencepools",
                "subresource": "status",
                "verb": "patch",
            }
        },
        {
            "resourceAttributes": {
                "group": "events.k8s.io",
                "namespace": "default",
                "resource": "events",
                "verb": "create",
            }
        },
    ]
    fake.grant_resource(fake.user_of(fake.token), "create", "events", "events.k8s.io")
    sources = await open_sources()
    assert sources.status_grants is not None and not sources.status_grants.status
    status = writer(sources)
    assert not await status.step()
    assert fake.event_reasons() == ["PoolReady"] and status_patches(fake) == []
    fake.grant_resource(
        fake.user_of(fake.token), "patch", "inferencepools/status", "inference.networking.k8s.io"
    )
    both = await open_sources()
    assert both.status_grants is not None and both.status_grants.status
    assert await writer(both).step() and shows(fake, "True", "Ready")()


async def test_a_review_the_api_server_does_not_serve_leaves_the_answer_to_the_writes(
    pool_pods: FakeApiServer, open_sources: Callable[..., Any]
) -> None:
    """A 404 from SelfSubjectAccessReview answers neither way: the picker starts, never asks again,
    and writes what it may (the condition here); what it may not fails and is counted."""
    fake = pool_pods
    fake.rbac()
    fake.grant_resource(
        fake.user_of(fake.token), "patch", "inferencepools/status", "inference.networking.k8s.io"
    )
    fake.fail_next(1, 404, resource="selfsubjectaccessreviews")
    sources = await open_sources()
    assert sources.status_grants is not None  # not "asked again at each look"
    status = writer(sources)
    assert await status.step() and shows(fake, "True", "Ready")()
    assert status.events["failed"] == 1 and status.events["created"] == 0  # no grant for events: said
    assert fake.self_reviews == []  # asked once, at start
