"""kube.pool_status at shutdown, through the real PickerApp on the fake API server, on every path:
a picker with leader election and no standby leaves the pool saying `Stopping`, not `Ready`; with a
standby, the standby's first look as the Lease's holder says `Ready` again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from loadtest.procs import async_wait_until
from picker.app import PickerApp
from picker.config.model import PickerConfig
from picker.config.sources import load_config
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.test_pool_status_kube import PICKER_REF, shows


def config_of(fake: FakeApiServer, tmp_path: Path, name: str) -> PickerConfig:
    kubeconfig = fake.write_kubeconfig(tmp_path / f"kc-{name}", token=fake.add_token(f"token-of-{name}"))
    return load_config(
        overrides={
            "server": {"grpc_port": 0, "health_port": 0, "metrics_port": 0, "secure_serving": False},
            "kube": {
                "pool_name": "vllm",
                "kubeconfig": str(kubeconfig),
                "pool_status": True,
                "pool_status_debounce_s": 0.05,
                "backoff_initial_s": 0.02,
            },
            "leader": {
                "enabled": True,
                "identity": name,
                "lease_duration_s": 1.0,
                "renew_deadline_s": 0.6,
                "retry_period_s": 0.05,
            },
            "load": {"scrape": False},
            "shutdown": {"propagation_s": 0},
        }
    )


@pytest.fixture
async def pickers(fake: FakeApiServer, tmp_path: Path) -> AsyncIterator[Callable[[str], PickerApp]]:
    fake.put_pool("vllm")
    fake.put_pod("vllm-0", "10.0.0.1")
    made: list[PickerApp] = []

    def make(name: str) -> PickerApp:
        made.append(PickerApp(config_of(fake, tmp_path, name)))
        return made[-1]

    yield make
    for app in made:
        await app.stop()


async def shut_down(app: PickerApp) -> None:
    force = asyncio.Event()
    force.set()  # no streams to wait for: straight through the phases
    await app.shutdown(force)


async def test_a_leader_without_a_standby_leaves_the_pool_saying_stopping(
    fake: FakeApiServer, pickers: Callable[[str], PickerApp]
) -> None:
    alone = pickers("picker-a")
    await alone.start()
    await async_wait_until(shows(fake, "True", "Ready"), 10, what="Ready from the leader")
    await shut_down(alone)
    assert shows(fake, "False", "Stopping")(), "the pool still says Ready with no picker left"
    assert fake.event_reasons()[-1] == "PickerStopping"


async def test_a_leader_with_a_standby_says_stopping_and_the_standby_says_ready_once_it_leads(
    fake: FakeApiServer, pickers: Callable[[str], PickerApp]
) -> None:
    """Only the Lease's holder is ready: between the leader's stop and the standby's first step as
    holder no picker serves, and the pool says so; then the new leader says Ready."""
    leader, standby = pickers("picker-a"), pickers("picker-b")
    await leader.start()
    await async_wait_until(shows(fake, "True", "Ready"), 10, what="Ready from the first leader")
    await standby.start()
    assert leader.core.leader is not None and leader.core.leader()
    await shut_down(leader)
    await async_wait_until(shows(fake, "True", "Ready"), 10, what="Ready from the new leader")
    assert standby.core.leader is not None and standby.core.leader()
    assert written(fake)[-2:] == ["Stopping", "Ready"]


def written(fake: FakeApiServer) -> list[str]:
    """The reasons of the picker's condition, in the order its status patches wrote them."""
    reasons = []
    for patch in fake.patches:
        parents = ((patch["body"].get("status") or {}).get("parents") or []) if patch["subresource"] else []
        reasons += [p["conditions"][0]["reason"] for p in parents if p["parentRef"] == PICKER_REF]
    return reasons
