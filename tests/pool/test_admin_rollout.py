"""The admin API's rollout routes and `picker rollout`: status, commands, auth, and a rollback that
drains the candidate through the drain store."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from picker.admin.api import admin_app
from picker.config.model import RolloutConfig
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.rollout import Canary, CanaryPlan
from picker.rollout import command as rollout_cli
from picker.rollout.runner import RolloutRunner
from picker.sources.drain_store import LocalDrains

TOKEN = "s3cret-admin-token-0123"
LABEL = "app.kubernetes.io/version"
CANDIDATE = "10.0.0.3:8000"


@pytest.fixture
def pool() -> Pool:
    pool = Pool()
    addresses = {a: EndpointState.READY for a in ("10.0.0.1:8000", "10.0.0.2:8000", CANDIDATE)}
    labels = {a: {LABEL: "v2" if a == CANDIDATE else "v1"} for a in addresses}
    pool.reconcile(addresses, "file", labels=labels)
    return pool


@pytest.fixture
async def served(pool: Pool) -> AsyncIterator[tuple[TestClient, RolloutRunner]]:
    runner = RolloutRunner(Canary(CanaryPlan.of(RolloutConfig(candidate="v2")), pool.now()), pool, 1.0)
    runner.store = LocalDrains(pool)
    metrics = Metrics(pool="default")
    metrics.register_rollout(runner.canary)
    app = admin_app(pool, metrics, token=TOKEN, drains=runner.store, rollout=runner)

    @web.middleware
    async def from_afar(
        request: web.Request, handler: Callable[..., Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        return await handler(request.clone(remote="10.9.9.9"))

    app.middlewares.insert(0, from_afar)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    yield client, runner
    await client.close()


async def test_status_then_abort_drains_the_candidate_and_resume_lifts_it(
    served: tuple[TestClient, RolloutRunner], pool: Pool
) -> None:
    client, _ = served
    status = (await (await client.get("/admin/rollout")).json())["rollout"]
    assert status["phase"] == "progressing" and status["weight"] == 5
    refused = await client.post("/admin/rollout/abort")
    assert refused.status == 401  # the same auth as drains
    auth = {"Authorization": f"Bearer {TOKEN}"}
    aborted = (await (await client.post("/admin/rollout/abort", headers=auth)).json())["rollout"]
    assert aborted["phase"] == "rolled-back" and aborted["weight"] == 0
    assert aborted["rollback"]["reason"] == "aborted by hand"
    assert pool.get(CANDIDATE).state is EndpointState.DRAINING  # type: ignore[union-attr]
    assert pool.get("10.0.0.1:8000").state is EndpointState.READY  # type: ignore[union-attr]
    page = await (await client.get("/metrics")).text()
    assert "picker_rollout_rollbacks_total 1.0" in page and "picker_rollout_weight 0.0" in page
    resumed = (await (await client.post("/admin/rollout/resume", headers=auth)).json())["rollout"]
    assert resumed["phase"] == "progressing" and resumed["weight"] == 5
    assert pool.get(CANDIDATE).state is EndpointState.READY  # type: ignore[union-attr]
    unknown = await client.post("/admin/rollout/launch", headers=auth)
    assert unknown.status == 404 and "promote" in (await unknown.json())["error"]["message"]


async def test_the_cli_reads_and_commands(
    served: tuple[TestClient, RolloutRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    client, runner = served
    url = str(client.make_url("/")).rstrip("/")
    args = argparse.Namespace(verb="status", url=url, token=None, json=False)
    assert await _run(args) == 0
    assert "phase progressing  weight 5%" in capsys.readouterr().out
    args = argparse.Namespace(verb="promote", url=url, token=None, json=False)
    assert await _run(args) == 1  # no token: refused, and said so
    assert "401" in capsys.readouterr().err
    args = argparse.Namespace(verb="promote", url=url, token=TOKEN, json=True)
    assert await _run(args) == 0 and runner.canary.phase == "promoted"


async def _run(args: argparse.Namespace) -> int:
    import asyncio

    return await asyncio.to_thread(rollout_cli.main, args)


async def test_without_a_rollout_the_routes_say_so(pool: Pool) -> None:
    client = TestClient(TestServer(admin_app(pool, Metrics(pool="default")), host="127.0.0.1"))
    await client.start_server()
    try:
        assert (await (await client.get("/admin/rollout")).json()) == {"rollout": None}
        answer = await client.post("/admin/rollout/promote")
        assert answer.status == 409
    finally:
        await client.close()


async def test_resume_lifts_only_the_drains_the_rollback_made(pool: Pool) -> None:
    """An operator drained one candidate replica before the rollback: resuming must not lift that
    drain (issue 40, item 6: it did, and with the endpoints file it removed `draining: true`)."""
    second = "10.0.0.4:8000"
    addresses = {a: EndpointState.READY for a in ("10.0.0.1:8000", CANDIDATE, second)}
    labels = {a: {LABEL: "v2" if a in (CANDIDATE, second) else "v1"} for a in addresses}
    pool.reconcile(addresses, "file", labels=labels)
    runner = RolloutRunner(Canary(CanaryPlan.of(RolloutConfig(candidate="v2")), pool.now()), pool, 1.0)
    runner.store = LocalDrains(pool)
    await runner.store.drain(second)  # the operator's
    await runner.command("abort")
    assert pool.get(CANDIDATE).state is EndpointState.DRAINING  # type: ignore[union-attr]
    await runner.command("resume")
    assert pool.get(CANDIDATE).state is EndpointState.READY  # type: ignore[union-attr]
    assert pool.get(second).state is EndpointState.DRAINING  # type: ignore[union-attr]


async def test_an_unobservable_gate_is_said_once_not_every_tick(
    pool: Pool, caplog: pytest.LogCaptureFixture
) -> None:
    """Each tick's log of decisions reset the set of gates already said to be unobservable, so the
    warning came again every tick (`rollout.tick_s`, 1 s by default)."""
    from picker.rollout import CANDIDATE as GROUP
    from picker.rollout import STABLE, Sample

    plan = CanaryPlan.of(RolloutConfig(candidate="v2", step_interval_s=100.0, window_s=5.0, min_samples=10))
    canary = Canary(plan, 0.0)
    clock = [0.0]
    runner = RolloutRunner(canary, pool, 1.0, clock=lambda: clock[0])
    for i in range(30):  # headers only: the streamed gates cannot be fed
        for group in (STABLE, GROUP):
            canary.ended(group, Sample(i * 0.05, cut=None, error=False, ttft_s=None, itl_s=None))
    caplog.set_level("WARNING", logger="picker.rollout.runner")
    for tick in range(3):
        clock[0] = 1.6 + tick
        await runner.tick()
    said = [r for r in caplog.records if "not observable" in r.getMessage()]
    gates = [r.getMessage().split()[2] for r in said]
    assert sorted(gates) == sorted(set(gates)) and gates, [r.getMessage() for r in said]


async def test_a_rollback_moves_the_candidates_streams_when_asked(
    served: tuple[TestClient, RolloutRunner], pool: Pool
) -> None:
    """rollout.move_streams (picker proxy): the rollback's drain of each candidate endpoint is
    followed by moving its resumable streams to stable replicas."""
    client, runner = served
    moved: list[str] = []

    async def move(address: str) -> tuple[int, dict[str, str]]:
        moved.append(address)
        return 3, {}

    runner.move_streams = move
    auth = {"Authorization": f"Bearer {TOKEN}"}
    aborted = (await (await client.post("/admin/rollout/abort", headers=auth)).json())["rollout"]
    assert aborted["phase"] == "rolled-back"
    assert moved == [CANDIDATE] and pool.get(CANDIDATE).state is EndpointState.DRAINING  # type: ignore[union-attr]


async def test_without_drain_on_rollback_resume_lifts_no_operators_drain(pool: Pool) -> None:
    """Issue 53, item 5: with drain_on_rollback false the rollback drained nothing, yet `resume`
    undrained the candidate's addresses, lifting the operator's drain made since."""
    runner = RolloutRunner(
        Canary(CanaryPlan.of(RolloutConfig(candidate="v2")), pool.now()), pool, 1.0, drain_on_rollback=False
    )
    runner.store = LocalDrains(pool)
    await runner.command("abort")
    assert pool.get(CANDIDATE).state is EndpointState.READY  # type: ignore[union-attr]
    await runner.store.drain(CANDIDATE)  # the operator's
    await runner.command("resume")
    assert pool.get(CANDIDATE).state is EndpointState.DRAINING  # type: ignore[union-attr]


async def test_an_operators_drain_of_a_rolled_back_replica_outlasts_the_resume(
    served: tuple[TestClient, RolloutRunner], pool: Pool
) -> None:
    client, runner = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    rolled = (await (await client.post("/admin/rollout/abort", headers=auth)).json())["rollout"]
    assert rolled["id"] == "app.kubernetes.io/version=v2" and rolled["rollback_drains"] == [CANDIDATE]
    drained = await client.post(f"/admin/endpoints/{CANDIDATE}/drain?force=true", headers=auth)
    rollback = {"cause": "rollback", "rollout": "app.kubernetes.io/version=v2"}
    assert (await drained.json())["endpoint"]["drained_by"] == [{"cause": "operator"}, rollback]
    await client.post("/admin/rollout/resume", headers=auth)
    assert pool.get(CANDIDATE).state is EndpointState.DRAINING  # type: ignore[union-attr]
    view = await (await client.get(f"/admin/endpoints/{CANDIDATE}")).json()
    assert view["endpoint"]["drained_by"] == [{"cause": "operator"}]
    assert runner.status()["rollback_drains"] == []


async def test_who_may_be_named_as_a_drains_cause_and_what_an_undrain_lifts(
    served: tuple[TestClient, RolloutRunner], pool: Pool
) -> None:
    client, _ = served
    auth = {"Authorization": f"Bearer {TOKEN}"}
    second = "10.0.0.2:8000"
    for bad in ("rollback", "everyone"):  # a rollback's drains are its rollout's
        answer = await client.post(f"/admin/endpoints/{second}/drain?cause={bad}", headers=auth)
        assert answer.status == 400 and "cause" in (await answer.json())["error"]["message"]
    assert (await client.post(f"/admin/endpoints/{second}/undrain?cause=nobody", headers=auth)).status == 400
    await client.post("/admin/rollout/abort", headers=auth)  # the candidate: the rollback's
    await client.post(f"/admin/endpoints/{CANDIDATE}/drain?cause=prestop&force=true", headers=auth)
    wrong = await client.post(f"/admin/endpoints/{CANDIDATE}/undrain?cause=operator", headers=auth)
    assert wrong.status == 409 and "holds no operator drain" in (await wrong.json())["error"]["message"]
    only = await (
        await client.post(f"/admin/endpoints/{CANDIDATE}/undrain?cause=rollback", headers=auth)
    ).json()
    assert only["lifted"] == [{"cause": "rollback", "rollout": "app.kubernetes.io/version=v2"}]
    assert only["endpoint"]["state"] == "draining" and only["endpoint"]["drained_by"] == [
        {"cause": "prestop"}
    ]
    every = await (await client.post(f"/admin/endpoints/{CANDIDATE}/undrain", headers=auth)).json()
    assert every["lifted"] == [{"cause": "prestop"}] and every["endpoint"]["state"] == "ready"
