"""InferenceObjectives -> request priorities: the pure lookup, and the pool source keeping it current."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loadtest.procs import async_wait_until
from picker.request.objectives import Objectives, request_priority
from picker.sources.kube import ApiFailure
from tests.kube.conftest import PoolSourceFactory
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.kube_objects import inference_objective


def objective(name: str, **fields: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "default"}, **inference_objective(**fields)}


def test_priorities_of_the_pools_objectives_and_the_default_for_the_rest() -> None:
    objectives = Objectives("vllm")
    problems = objectives.replace(
        [
            objective("critical", priority=10),
            objective("batch", priority=-5),
            objective("unset"),  # no priority: 0, as the API documents
            objective("elsewhere", priority=99, pool="other-pool"),
            {"metadata": {"name": "bad"}, "spec": {"poolRef": {"name": "vllm"}, "priority": "high"}},
        ]
    )
    assert problems == ["InferenceObjective bad: spec.priority 'high' is not an integer; default used"]
    assert objectives.known() == {"critical": 10, "batch": -5, "unset": 0}
    assert objectives.priority("critical") == 10 and objectives.priority("batch") == -5
    assert objectives.priority("elsewhere") == 0 and objectives.priority("nope") == 0
    assert objectives.priority(None) == 0 and objectives.priority("") == 0
    objectives.apply("MODIFIED", objective("critical", priority=10, pool="other-pool"))  # moved away
    objectives.apply("DELETED", objective("batch"))
    assert objectives.known() == {"unset": 0}


def test_the_plural_pool_refs_form_counts_too() -> None:
    objectives = Objectives("vllm", default=3)
    obj = {"metadata": {"name": "x"}, "spec": {"poolRefs": [{"name": "a"}, {"name": "vllm"}], "priority": 1}}
    objectives.apply("ADDED", obj)
    assert objectives.priority("x") == 1 and objectives.priority("y") == 3


async def test_the_pool_source_keeps_the_objectives_current(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory
) -> None:
    fake.put_pool("vllm")
    fake.put_objective("critical", priority=10)
    objectives = Objectives("vllm")
    source = make_pool_source(objectives=objectives)
    await source.first_load()
    assert objectives.priority("critical") == 10
    task = asyncio.create_task(source.run())
    try:
        await async_wait_until(lambda: fake.live_watches == 3, 5, what="pool, pod and objective watches")
        fake.put_objective("critical", priority=20)
        fake.put_objective("batch", priority=-1)
        fake.drop_watches()  # the same faults as every other watch
        fake.delete("inferenceobjectives", "critical")
        await async_wait_until(lambda: objectives.known() == {"batch": -1}, 5, what="the changes")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert objectives.priority("critical") == 0


async def test_unreadable_objectives_do_not_hold_up_the_endpoints(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    fake.put_pool("vllm")
    fake.put_pod("vllm-0", "10.0.0.1")
    fake.put_objective("critical", priority=10)
    objectives = Objectives("vllm")
    source = make_pool_source(objectives=objectives)
    fake.fail_next(1, 403, resource="inferenceobjectives")  # no RBAC for them (yet)
    await source.first_load()
    assert "InferenceObjectives not readable yet (api-error" in caplog.text
    assert objectives.priority("critical") == 0 and source.problem is None
    assert source.pods is not None and len(source.pods.store) == 1
    task = asyncio.create_task(source.run())
    try:
        await async_wait_until(lambda: objectives.priority("critical") == 10, 5, what="the retried list")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_request_priority_header_overrides_the_objective() -> None:
    objectives = Objectives("vllm")
    objectives.apply("ADDED", objective("critical", priority=10))
    assert request_priority(None, "critical", objectives) == 10
    assert request_priority(" ", "critical", objectives) == 10
    assert request_priority("-3", "critical", objectives) == -3
    assert request_priority(None, "unknown", objectives) == 0
    assert request_priority(None, None, objectives) == 0
    assert request_priority(None, "critical", None) == 0  # no pool source: header only
    assert request_priority("7", None, None) == 7
    assert request_priority("high", "critical", objectives) is None


async def test_a_missing_objective_crd_says_how_to_do_without(
    fake: FakeApiServer, make_pool_source: PoolSourceFactory
) -> None:
    fake.put_pool("vllm")
    source = make_pool_source(objectives=Objectives("vllm"))
    assert source.objectives_watch is not None
    fake.fail_next(1, 404, resource="inferenceobjectives")
    with pytest.raises(ApiFailure, match=r"CRD installed\? \(or run the picker with --no-objectives\)"):
        await source.objectives_watch.relist()
