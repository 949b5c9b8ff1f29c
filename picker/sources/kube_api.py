"""The Kubernetes collections over lightkube: its configuration, auth, HTTP client, paging and
decoders; our watch loop. `LightkubeCollection` lists and watches one resource (EndpointSlices, pods,
InferencePools, InferenceObjectives) by label and field selector; `LightkubeSliceApi` and
`LightkubePoolApi` are what the two Kubernetes sources use.

What lightkube 1.0.1 does (read in its source; tests/kube/test_lightkube_facts.py pins it):
- `AsyncClient.watch` reads with no timeout (`Timeout.read = None`): a silently dead connection hangs
  forever. It cannot ask for bookmarks (no `allowWatchBookmarks` parameter), and a BOOKMARK object
  fails its EndpointSlice model decode (`addressType` is required).
- On a 410 it raises by default; if its `on_error` handler asks to retry, it drops the version and
  watches from "now" (no longer from the same expired version, as v0.21 did) but never relists, so
  deletes missed meanwhile are never reported.
So the list -> watch -> relist loop is ours (kube.py). This adapter uses lightkube for the kubeconfig
or in-cluster service account (with token rotation), the authenticated httpx2 client, request
building, list paging and model decoding, and streams one watch request itself. Library exceptions
are mapped to the loop's errors here, in one place.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx2
import msgspec
from lightkube.config.client_adapter import ConnectionParams
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core import decoders
from lightkube.core.generic_client import GenericAsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice

from picker.config.model import ConfigError
from picker.sources.kube import ApiFailure, BadData, Disconnected, Expired, SourceError, WatchEvent

_MAX_ERROR_BODY = 64 * 1024

InferencePool = create_namespaced_resource(
    "inference.networking.k8s.io", "v1", "InferencePool", "inferencepools"
)
InferenceObjective = create_namespaced_resource(
    "inference.networking.x-k8s.io", "v1alpha2", "InferenceObjective", "inferenceobjectives"
)
# What the 403 message says the picker needs, per resource.
_RBAC = {
    EndpointSlice: "endpointslices (discovery.k8s.io)",
    Pod: "pods (core)",
    InferencePool: "inferencepools (inference.networking.k8s.io)",
    InferenceObjective: "inferenceobjectives (inference.networking.x-k8s.io)",
}


class _Meta(msgspec.Struct):
    resourceVersion: str = ""  # the API's field name


class _Bookmark(msgspec.Struct):
    metadata: _Meta = msgspec.field(default_factory=_Meta)


def load_kubeconfig(path: Path | None) -> KubeConfig:
    """The given kubeconfig, else the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    try:
        return KubeConfig.from_file(path) if path is not None else KubeConfig.from_env()
    except Exception as exc:  # lightkube raises ConfigError, KeyError, OSError, YAML errors
        where = str(path) if path is not None else "service account / $KUBECONFIG / ~/.kube/config"
        raise ConfigError(f"kube: cannot load the Kubernetes client configuration ({where}): {exc}") from exc


def decode_event(line: str | bytes, res: type[Any] = EndpointSlice) -> WatchEvent:
    """One line of a watch stream of `res` -> WatchEvent; BadData when it is not a well-formed event."""
    raw = line.encode() if isinstance(line, str) else line
    try:
        event = decoders.decode_watch_event(raw)
        match event.type:
            case "ADDED" | "MODIFIED" | "DELETED":
                obj = decoders.decode_object(event.object, res)
                version = obj.metadata.resourceVersion if obj.metadata is not None else None
                return WatchEvent(event.type, obj.to_dict(), version)
            case "BOOKMARK":
                mark = msgspec.json.decode(event.object, type=_Bookmark)
                return WatchEvent("BOOKMARK", version=mark.metadata.resourceVersion or None)
            case "ERROR":
                status = decoders.decode_status(event.object)
                return WatchEvent("ERROR", code=status.code, message=status.message or status.reason or "")
            case other:
                raise BadData(f"unknown watch event type {other!r}")
    except msgspec.MsgspecError as exc:
        raise BadData(f"undecodable watch event ({len(raw)} bytes): {exc}") from None


def _status_error(
    code: int, body: bytes, what: str, namespace: str, res: type[Any] = EndpointSlice
) -> SourceError:
    try:
        status = decoders.decode_status(body)
        detail = status.message or status.reason or ""
    except msgspec.MsgspecError:
        detail = f"{len(body)}-byte non-Status body"
    match code:
        case 410:
            return Expired(detail)
        case 401:
            return ApiFailure(f"{what}: 401 unauthorized ({detail}): check the token or kubeconfig")
        case 403:
            return ApiFailure(
                f"{what}: 403 forbidden ({detail}): the picker needs get/list/watch on "
                f"{_RBAC.get(res, res.__name__)} in namespace {namespace}"
            )
        case 404 if res in (InferencePool, InferenceObjective):
            hint = " (or run the picker with --no-objectives)" if res is InferenceObjective else ""
            return ApiFailure(f"{what}: 404 not found ({detail}): is the {_RBAC[res]} CRD installed?{hint}")
        case _:
            return ApiFailure(f"{what}: HTTP {code} ({detail})")


@contextlib.contextmanager
def _mapped(what: str, namespace: str, res: type[Any] = EndpointSlice) -> Iterator[None]:
    """lightkube / httpx2 / msgspec exceptions -> the loop's SourceError kinds."""
    try:
        yield
    except SourceError:
        raise
    except httpx2.HTTPStatusError as exc:
        raise _status_error(exc.response.status_code, exc.response.content, what, namespace, res) from None
    except httpx2.HTTPError as exc:  # transport: refused, reset, timeout, broken chunked stream
        raise Disconnected(f"{what}: {type(exc).__name__}: {exc}") from None
    except msgspec.MsgspecError as exc:
        raise BadData(f"{what}: undecodable answer: {exc}") from None


def make_client(config: KubeConfig, namespace: str | None, request_timeout_s: float) -> GenericAsyncClient:
    """The authenticated async client; ConfigError when it cannot even be built.

    No namespace configured: $NAMESPACE (the reference picker's chart sets it from the downward
    API), else the service account's, else the kubeconfig context's."""
    namespace = namespace or os.environ.get("NAMESPACE") or None
    params = ConnectionParams(timeout=httpx2.Timeout(request_timeout_s))
    try:
        return GenericAsyncClient(params, config=config, namespace=namespace)
    except Exception as exc:  # no current context, unreadable CA or client certificate, ...
        raise ConfigError(f"kube: cannot build the Kubernetes client: {exc}") from exc


class LightkubeCollection:
    """One resource in one namespace, filtered by label and/or field selector: list (paged) and watch."""

    def __init__(
        self,
        client: GenericAsyncClient,
        res: type[Any],
        *,
        namespace: str,
        label_selector: str = "",
        field_selector: str = "",
        request_timeout_s: float,
        read_timeout_s: float,
        page_size: int = 500,
    ) -> None:
        self._client = client
        self._res = res
        self.namespace = namespace
        self._filters = {
            key: value
            for key, value in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if value
        }
        self._request_timeout_s = request_timeout_s
        self._read_timeout_s = read_timeout_s
        self._page_size = page_size

    async def list(self) -> tuple[list[Mapping[str, Any]], str]:
        request = self._client.prepare_request(
            "list",
            res=self._res,
            namespace=self.namespace,
            params={**self._filters, "limit": self._page_size},
        )
        items: list[Mapping[str, Any]] = []
        version: str | None = None
        with _mapped("list", self.namespace, self._res):
            async for page_version, page in self._client.list_chunks(request):
                version = page_version
                items.extend(item.to_dict() for item in page)
        if not version:
            raise BadData("list answer without metadata.resourceVersion")
        return items, version

    @contextlib.asynccontextmanager
    async def watch(self, version: str, timeout_s: int) -> AsyncIterator[AsyncIterator[WatchEvent]]:
        request = self._client.prepare_request(
            "list",
            res=self._res,
            namespace=self.namespace,
            watch=True,
            params={
                **self._filters,
                "resourceVersion": version,
                "allowWatchBookmarks": "true",
                "timeoutSeconds": timeout_s,
            },
        )
        # A backstop only: the loop's inactivity deadline is meant to fire first.
        request.timeout = httpx2.Timeout(self._request_timeout_s, read=self._read_timeout_s)
        with _mapped("watch", self.namespace, self._res):
            response = await self._client.send(self._client.build_adapter_request(request), stream=True)
        try:
            if response.status_code != 200:
                with _mapped("watch", self.namespace, self._res):
                    body = await anext(response.aiter_bytes(_MAX_ERROR_BODY), b"")
                raise _status_error(response.status_code, body, "watch", self.namespace, self._res)
            yield self._events(response)
        finally:
            await response.aclose()

    async def _events(self, response: httpx2.Response) -> AsyncIterator[WatchEvent]:
        with _mapped("watch", self.namespace, self._res):
            async for line in response.aiter_lines():
                if line.strip():
                    yield decode_event(line, self._res)


class LightkubeSliceApi:
    """The slices of one label selector in one namespace, listed and watched through lightkube."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        selector: str,
        namespace: str | None,
        request_timeout_s: float,
        read_timeout_s: float,
        page_size: int = 500,
    ) -> None:
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace
        self.server: str = self._client.config.cluster.server
        self._slices = LightkubeCollection(
            self._client,
            EndpointSlice,
            namespace=self.namespace,
            label_selector=selector,
            request_timeout_s=request_timeout_s,
            read_timeout_s=read_timeout_s,
            page_size=page_size,
        )

    async def list_slices(self) -> tuple[list[Mapping[str, Any]], str]:
        return await self._slices.list()

    def watch_slices(
        self, version: str, timeout_s: int
    ) -> contextlib.AbstractAsyncContextManager[AsyncIterator[WatchEvent]]:
        return self._slices.watch(version, timeout_s)

    async def aclose(self) -> None:
        await self._client.close()


class LightkubePoolApi:
    """An InferencePool by name, its pods by label selector, and the namespace's InferenceObjectives."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        namespace: str | None,
        request_timeout_s: float,
        read_timeout_s: float,
        page_size: int = 500,
    ) -> None:
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace
        self.server: str = self._client.config.cluster.server
        self._request_timeout_s = request_timeout_s
        self._read_timeout_s = read_timeout_s
        self._page_size = page_size

    def pools(self, name: str) -> LightkubeCollection:
        return self._collection(InferencePool, field_selector=f"metadata.name={name}")

    def pods(self, selector: str) -> LightkubeCollection:
        return self._collection(Pod, label_selector=selector)

    def objectives(self) -> LightkubeCollection:
        return self._collection(InferenceObjective)

    def _collection(self, res: type[Any], **filters: str) -> LightkubeCollection:
        return LightkubeCollection(
            self._client,
            res,
            namespace=self.namespace,
            request_timeout_s=self._request_timeout_s,
            read_timeout_s=self._read_timeout_s,
            page_size=self._page_size,
            **filters,
        )

    async def aclose(self) -> None:
        await self._client.close()
