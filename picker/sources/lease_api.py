"""The leader Lease (coordination.k8s.io/v1) over lightkube: get, create, replace."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx2
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease

from picker.sources.kube import ApiFailure, Disconnected
from picker.sources.kube_api import make_client
from picker.sources.kube_drains import WriteConflict
from picker.sources.lease import Election, Elector, LeaseInvalid, LeaseRecord, lease_record

if TYPE_CHECKING:
    from picker.config.model import PickerConfig


class LightkubeLeaseApi:
    """One Lease by name in the picker's namespace."""

    def __init__(self, config: KubeConfig, name: str, *, namespace: str | None, request_timeout_s: float):
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace
        self.name = name

    async def read(self) -> tuple[LeaseRecord | None, str | None]:
        try:
            obj: Any = await self._client.request("get", Lease, name=self.name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return None, None
            raise self._failure("get", exc) from None
        except httpx2.HTTPError as exc:
            raise Disconnected(f"get lease {self.name}: {type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # the client library's decoding refused a field (msgspec)
            raise LeaseInvalid("malformed", str(exc)) from None
        return lease_record(spec_fields(obj.spec)), obj.metadata.resourceVersion

    async def write(self, record: LeaseRecord, version: str | None) -> str | None:
        spec = LeaseSpec(
            holderIdentity=record.holder,
            leaseDurationSeconds=max(1, round(record.duration_s)),
            leaseTransitions=record.transitions,
            acquireTime=record.acquired,
            renewTime=record.renewed,
        )
        meta = ObjectMeta(name=self.name, namespace=self.namespace, resourceVersion=version)
        method = "post" if version is None else "put"
        try:
            obj: Any = await self._client.request(
                method,
                obj=Lease(metadata=meta, spec=spec),
                name=None if version is None else self.name,
                namespace=self.namespace,
            )
        except httpx2.HTTPStatusError as exc:
            if exc.response.status_code == 409:
                raise WriteConflict(str(exc)) from None
            raise self._failure(method, exc) from None
        except httpx2.HTTPError as exc:
            raise Disconnected(f"{method} lease {self.name}: {type(exc).__name__}: {exc}") from None
        return obj.metadata.resourceVersion  # type: ignore[no-any-return]

    def _failure(self, verb: str, exc: httpx2.HTTPStatusError) -> ApiFailure:
        code = exc.response.status_code
        hint = ""
        if code == 403:
            hint = f": the picker needs get/create/update on leases (coordination.k8s.io) in {self.namespace}"
        return ApiFailure(f"{verb} lease {self.name}: HTTP {code}{hint}")

    async def aclose(self) -> None:
        await self._client.close()


def spec_fields(spec: LeaseSpec | None) -> dict[str, Any]:
    """The fields of a decoded Lease spec the election reads (their decoded types, unchecked)."""
    names = ("holderIdentity", "leaseDurationSeconds", "leaseTransitions", "acquireTime", "renewTime")
    return {name: getattr(spec, name, None) for name in names}


def lease_name(config: PickerConfig) -> str:
    """`leader.lease_name`, else one per pool (replicas of one picker share it, other pools' do not)."""
    kube = config.kube
    return config.leader.lease_name or f"{kube.pool_name or kube.service or 'inference-picker'}-picker-leader"


def identity(config: PickerConfig) -> str:
    """`leader.identity`, else the pod's name (the reference chart sets $POD_NAME), else a unique one."""
    if config.leader.identity:
        return config.leader.identity
    if os.environ.get("POD_NAME"):
        return os.environ["POD_NAME"]
    return f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def open_election(config: PickerConfig, on_change: Callable[[bool], None]) -> Election:
    """The campaign `leader` configures, over the kube settings' API server and namespace."""
    from picker.sources.kube_api import load_kubeconfig

    leader, kube = config.leader, config.kube
    api = LightkubeLeaseApi(
        load_kubeconfig(kube.kubeconfig),
        lease_name(config),
        namespace=kube.namespace,
        request_timeout_s=min(kube.request_timeout_s, leader.renew_deadline_s),
    )
    elector = Elector(identity(config), leader.lease_duration_s, leader.renew_deadline_s)
    return Election(api, elector, leader.retry_period_s, on_change)
