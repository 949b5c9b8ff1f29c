"""Drains know who made them (issue 53, item 5), on the fake API server with two `picker serve`s
sharing the drain ConfigMap: an operator's drain, a preStop hook's and a rollback's of the same
candidate replicas; the picker that rolled back restarts before the rollout is resumed, and the
resume lifts the rollback's drains only. Before causes, a `resume` that reached a picker which had
not recorded the rollback's drain itself (a restart, the other picker) lifted every drain of the
address, the operator's included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest import http_client
from picker.app import PickerApp
from picker.pool import EndpointState
from picker.sources.drain_record import DATA_KEY
from tests.kube.fake_apiserver import FakeApiServer
from tests.kube.test_shared_drains_kube import apps_config, until

NAME = "vllm-picker-drains"
VERSION = "app.kubernetes.io/version"
STABLE, X, Y, Z = "10.0.0.1:8000", "10.0.0.3:8000", "10.0.0.4:8000", "10.0.0.5:8000"
ROLLOUT = f"{VERSION}=v2"


def recorded(fake: FakeApiServer) -> list[Any]:
    (obj,) = [o for o in fake.objects(selector="", resource="configmaps") if o["metadata"]["name"] == NAME]
    return list(json.loads(obj["data"][DATA_KEY]))


def state(app: PickerApp, address: str) -> EndpointState | None:
    endpoint = app.pool.get(address)
    return None if endpoint is None else endpoint.state


class Admin:
    """One picker's admin port, from loopback (no admin token: an operator's port-forward)."""

    def __init__(self, app: PickerApp, port: int) -> None:
        self.app, self.url = app, f"http://127.0.0.1:{port}"

    async def call(self, method: str, path: str) -> dict[str, Any]:
        async with http_client.AsyncClient() as client:
            answer = await client.request(method, self.url + path, timeout=5)
        assert answer.status_code == 200, (path, answer.status_code, answer.text)
        return dict(answer.json())


async def test_a_resume_after_a_restart_lifts_only_its_rollbacks_drains(
    fake: FakeApiServer, kubeconfig: Path
) -> None:
    fake.put_pod("vllm-0", "10.0.0.1", labels={"app": "vllm", VERSION: "v1"})
    for name, ip in (("vllm-x", "10.0.0.3"), ("vllm-y", "10.0.0.4"), ("vllm-z", "10.0.0.5")):
        fake.put_pod(name, ip, labels={"app": "vllm", VERSION: "v2"})
    fake.put_pool("vllm")
    config = apps_config(kubeconfig, NAME, rollout={"candidate": "v2", "stable": "v1", "tick_s": 60})
    first, second = PickerApp(config), PickerApp(config)
    one = Admin(first, (await first.start()).metrics)
    try:
        two = Admin(second, (await second.start()).metrics)
        try:
            await until(lambda: all(state(app, Z) is EndpointState.READY for app in (first, second)))
            # the first picker rolls the canary back: every candidate drained, its rollback's
            rolled = (await one.call("POST", "/admin/rollout/abort"))["rollout"]
            assert rolled["phase"] == "rolled-back" and rolled["id"] == ROLLOUT
            # through the other picker: an operator's drain of X, a preStop hook's of Y
            drained = await two.call("POST", f"/admin/endpoints/{X}/drain")
            assert drained["endpoint"]["state"] == "draining"
            await two.call("POST", f"/admin/endpoints/{Y}/drain?cause=prestop")
            rollback = {"cause": "rollback", "rollout": ROLLOUT}
            items = recorded(fake)
            assert X in items and {"address": Y, "cause": "prestop"} in items
            assert sorted(
                i["address"] for i in items if isinstance(i, dict) and i.get("cause") == "rollback"
            ) == [
                X,
                Y,
                Z,
            ]
            assert all(
                i["pod"].startswith("uid-vllm-") for i in items if isinstance(i, dict) and "rollout" in i
            )
            await until(lambda: all(second.pool.admin_drained(a) for a in (X, Y, Z)))
            shown = {
                e["address"]: e["drained_by"]
                for e in (await two.call("GET", "/admin/endpoints"))["endpoints"]
            }
            assert shown[X] == [{"cause": "operator"}, rollback]
            assert shown[Y] == [{"cause": "prestop"}, rollback]
            assert shown[Z] == [rollback] and shown[STABLE] == []

            # the picker that rolled back restarts: it remembers nothing of the rollback
            await first.stop()
            first = PickerApp(config)
            one = Admin(first, (await first.start()).metrics)
            await until(lambda: all(first.pool.admin_drained(a) for a in (X, Y, Z)))
            status = (await one.call("GET", "/admin/rollout"))["rollout"]
            assert status["phase"] == "progressing" and status["rollback_drains"] == [X, Y, Z]
            open_drains = (await one.call("GET", "/admin/drains"))["drains"]
            assert {d["address"]: d["drained_by"] for d in open_drains if d["open"]}[Y] == [
                {"cause": "prestop"},
                rollback,
            ]

            resumed = (await one.call("POST", "/admin/rollout/resume"))["rollout"]
            assert resumed["rollback_drains"] == []
            assert sorted(recorded(fake), key=json.dumps) == sorted(
                [X, {"address": Y, "cause": "prestop"}], key=json.dumps
            )
            for app in (first, second):
                await until(lambda app=app: state(app, Z) is EndpointState.READY)
                assert state(app, X) is EndpointState.DRAINING  # the operator's drain stays
                assert state(app, Y) is EndpointState.DRAINING  # the preStop hook's too

            # the operator may lift any drain; the answer says whose it lifted
            lifted = await two.call("POST", f"/admin/endpoints/{Y}/undrain")
            assert lifted["lifted"] == [{"cause": "prestop"}] and lifted["endpoint"]["drained_by"] == []
            assert recorded(fake) == [X]
        finally:
            await second.stop()
    finally:
        await first.stop()
