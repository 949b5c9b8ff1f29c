"""The drain-record ConfigMap over lightkube: list/watch (the loop's Collection), get, create, replace."""

from __future__ import annotations

from typing import Any

import httpx2
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap

from picker.config.model import KubeSourceConfig
from picker.pool import Pool
from picker.sources.drain_record import DATA_KEY, Record, parse_record, render_record
from picker.sources.kube import ApiFailure, Collection, Disconnected, WatchSettings
from picker.sources.kube_api import LightkubeCollection, load_kubeconfig, make_client
from picker.sources.kube_drains import ConfigMapDrains, WriteConflict


class LightkubeDrainRecordApi:
    """One ConfigMap by name in the picker's namespace."""

    def __init__(
        self,
        config: KubeConfig,
        name: str,
        *,
        namespace: str | None,
        request_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace
        self.name = name
        self._collection = LightkubeCollection(
            self._client,
            ConfigMap,
            namespace=self.namespace,
            field_selector=f"metadata.name={name}",
            request_timeout_s=request_timeout_s,
            read_timeout_s=read_timeout_s,
        )

    def collection(self) -> Collection:
        return self._collection

    async def read(self) -> tuple[Record, str | None]:
        try:
            obj: Any = await self._client.request("get", ConfigMap, name=self.name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:
            if exc.response.status_code == 404:
                return Record(), None
            raise self._failure("get", exc) from None
        except httpx2.HTTPError as exc:
            raise Disconnected(f"get configmap {self.name}: {type(exc).__name__}: {exc}") from None
        record, _ = parse_record(obj.to_dict())
        return record, obj.metadata.resourceVersion

    async def write(self, record: Record, version: str | None) -> None:
        meta = ObjectMeta(name=self.name, namespace=self.namespace, resourceVersion=version)
        obj = ConfigMap(metadata=meta, data={DATA_KEY: render_record(record)})
        method = "post" if version is None else "put"
        name = None if version is None else self.name
        try:
            await self._client.request(method, obj=obj, name=name, namespace=self.namespace)
        except httpx2.HTTPStatusError as exc:
            if exc.response.status_code == 409:
                raise WriteConflict(str(exc)) from None
            raise self._failure(method, exc) from None
        except httpx2.HTTPError as exc:
            raise Disconnected(f"{method} configmap {self.name}: {type(exc).__name__}: {exc}") from None

    def _failure(self, verb: str, exc: httpx2.HTTPStatusError) -> ApiFailure:
        code = exc.response.status_code
        hint = ""
        if code == 403:
            hint = f": the picker needs get/list/watch/create/update on configmaps in {self.namespace}"
        return ApiFailure(f"{verb} configmap {self.name}: HTTP {code}{hint}")

    async def aclose(self) -> None:
        await self._client.close()


def open_configmap_drains(
    kube: KubeSourceConfig, pool: Pool
) -> tuple[ConfigMapDrains, LightkubeDrainRecordApi]:
    """The drain store over kube.drains_configmap (its watch still to be run) and its API client."""
    assert kube.drains_configmap is not None
    api = LightkubeDrainRecordApi(
        load_kubeconfig(kube.kubeconfig),
        kube.drains_configmap,
        namespace=kube.namespace,
        request_timeout_s=kube.request_timeout_s,
        read_timeout_s=kube.inactivity_deadline_s + kube.request_timeout_s,
    )
    settings = WatchSettings(
        watch_timeout_s=kube.watch_timeout_s,
        inactivity_deadline_s=kube.inactivity_deadline_s,
        backoff_initial_s=kube.backoff_initial_s,
        backoff_max_s=kube.backoff_max_s,
    )
    return ConfigMapDrains(api, pool, settings), api
