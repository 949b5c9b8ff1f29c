"""One namespace of a cluster, played on the fake API server (tests/kube/fake_apiserver.py) in this
process: a Deployment's model-server pods (simulated vLLM replicas, all in one process, each on a
port of its own), one EndpointSlice per pod (its own port, its targetRef naming the pod, as the
EndpointSlice controller writes them for a named target port), and the controllers that act on them:

- the ReplicaSet controller's scale-down: it deletes the pods `replicaset.victims` puts first (the
  pod-deletion-cost annotation, when the picker writes it; otherwise its own rule: youngest first);
- the EndpointSlice controller: a deleted pod's endpoint turns terminating (the picker stops sending
  it work) and goes once the pod is gone;
- the kubelet: the replica gets the signal at once and drains (the simulator's --shutdown-timeout
  drain mode, as vLLM's: in-flight requests finish, new ones are refused), and what is still
  running at the grace period is cut (`on_drain_timeout: abort`, as a SIGKILL would);
- a scale-up: pods for replicas that wait, unlisted, on ports of the same simulator process.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from loadtest import http_client
from loadtest.procs import port_open
from loadtest.scale_down.replicaset import victims
from tests.kube.fake_apiserver import FakeApiServer

LABELS = {"app": "vllm", "pod-template-hash": "5d8f7c9b4"}
SERVICE = "vllm"
IMAGE = "vllm/vllm-openai:v0.32.0"


def stamp(at: float) -> str:
    """An API timestamp (RFC 3339, seconds) for a time.time() value."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Deletion:
    pod: str
    address: str
    at_s: float  # on the run's clock (seconds since the load started)
    cost: str | None  # its pod-deletion-cost annotation when the controller chose it
    ranked: list[str] = field(default_factory=list)  # the controller's order at that moment, pod names
    addresses: dict[str, str] = field(default_factory=dict)  # every pod then -> its replica's address


class Cluster:
    """The pods, slices and controllers of one run (see the module's docstring)."""

    def __init__(self, fake: FakeApiServer, ports: list[int], grace_s: float, origin: float) -> None:
        self.fake = fake
        self.waiting = list(ports)  # replicas started but not yet in the Deployment
        self.grace_s = grace_s
        self.origin = origin  # time.monotonic() of the run's time zero
        self.address_of: dict[str, str] = {}  # pod name -> 127.0.0.1:port
        self.deletions: list[Deletion] = []

    def now(self) -> float:
        return time.monotonic() - self.origin

    def add_pod(self, age_s: float = 0.0) -> str:
        """A new pod of the Deployment, ready, `age_s` old, and its slice."""
        port = self.waiting.pop(0)
        name, address = f"vllm-{port}", f"127.0.0.1:{port}"
        born = stamp(time.time() - age_s)
        self.fake.put(
            "pods",
            name,
            {
                "spec": {
                    "nodeName": "node-1",
                    "containers": [{"name": "vllm", "image": IMAGE, "ports": [{"containerPort": port}]}],
                },
                "status": {
                    "phase": "Running",
                    "podIP": "127.0.0.1",
                    "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": born}],
                    "containerStatuses": [
                        {
                            "name": "vllm",
                            "image": IMAGE,
                            "imageID": "docker.io/vllm/vllm-openai@sha256:" + "0" * 64,
                            "restartCount": 0,
                            "ready": True,
                            "started": True,
                            "state": {"running": {"startedAt": born}},
                        }
                    ],
                },
            },
            labels=dict(LABELS),
            metadata={"creationTimestamp": born},
        )
        self._slice(name, port, ready=True)
        self.address_of[name] = address
        return name

    def _slice(self, pod: str, port: int, *, ready: bool) -> None:
        conditions = {"ready": ready, "serving": True, "terminating": not ready}
        entry = {
            "addresses": ["127.0.0.1"],
            "conditions": conditions,
            "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
        }
        self.fake.put_slice(
            pod, [entry], service=SERVICE, ports=[{"name": "http", "port": port, "protocol": "TCP"}]
        )

    def pods(self) -> list[dict[str, Any]]:
        return self.fake.objects(selector="app=vllm", resource="pods")

    async def scale_down(self, count: int) -> list[Deletion]:
        """The ReplicaSet controller removes `count` replicas: the pods its order puts first."""
        pods = self.pods()
        wall = time.time()
        chosen = victims(pods, count, wall)
        ranked = [p["metadata"]["name"] for p in victims(pods, len(pods), wall)]
        made = []
        for pod in chosen:
            name = pod["metadata"]["name"]
            cost = (pod["metadata"].get("annotations") or {}).get(
                "controller.kubernetes.io/pod-deletion-cost"
            )
            everyone = {n: self.address_of[n] for n in ranked}
            made.append(Deletion(name, self.address_of[name], self.now(), cost, ranked, everyone))
            await self._delete(pod)
        self.deletions += made
        return made

    async def _delete(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        port = int(self.address_of[name].rsplit(":", 1)[1])
        meta = copy.deepcopy(pod["metadata"])
        meta.update(
            deletionTimestamp=stamp(time.time() + self.grace_s),
            deletionGracePeriodSeconds=round(self.grace_s),
        )
        body = {k: v for k, v in pod.items() if k not in ("kind", "apiVersion", "metadata")}
        labels = meta.pop("labels", {})
        for key in ("name", "namespace", "uid", "resourceVersion", "generation"):
            meta.pop(key, None)
        self.fake.put("pods", name, body, labels=labels, metadata=meta)
        self._slice(name, port, ready=False)
        async with http_client.AsyncClient(timeout=2.0) as client:
            answer = await client.post(
                f"http://127.0.0.1:{port}/sim/shutdown",
                json={"timeout": self.grace_s, "on_drain_timeout": "abort"},
            )
        answer.raise_for_status()

    async def reap(self, deletion: Deletion, bound_s: float) -> None:
        """Once its replica has stopped listening (bounded by `bound_s`), the pod and its slice go."""
        port = int(deletion.address.rsplit(":", 1)[1])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + bound_s
        while loop.time() < deadline and await asyncio.to_thread(port_open, port):  # noqa: ASYNC110
            await asyncio.sleep(0.1)  # polling a port the replica closes: a condition with a deadline
        self.fake.delete("endpointslices", deletion.pod)
        self.fake.delete("pods", deletion.pod)


async def shutdown_all(ports: list[int]) -> None:
    """Stop every replica still up, at once (the run is over)."""
    async with http_client.AsyncClient(timeout=2.0) as client:
        for port in ports:
            try:
                await client.post(
                    f"http://127.0.0.1:{port}/sim/shutdown", json={"timeout": 0.0, "force": True}
                )
            except httpx.HTTPError:
                pass
