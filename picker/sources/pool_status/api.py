"""The Kubernetes side, over lightkube: may this picker write the pool's status and record events (self
access reviews), the pool's `status.parents` as stored, that list written back, one Event created.

`status.parents` is an atomic list (`+listType=atomic` in the v1 CRD): neither a JSON merge patch nor
a server-side apply can change one entry of it, only the whole list. So the writer reads the list,
replaces its own entry and writes the list back as a merge patch of the `status` subresource with
`metadata.resourceVersion` as a precondition: a gateway controller that wrote in between gets its
entries kept (409, read again next time), never overwritten. Server-side apply would make this
picker's field manager own the whole list, and a controller's next apply would conflict over it.
Answers are read as JSON, not decoded into the client library's models (a field they do not know must
not fail a write that went through). Library exceptions are mapped to the writer's errors here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx2
from lightkube.config.kubeconfig import KubeConfig
from lightkube.resources.events_v1 import Event
from lightkube.types import PatchType

from picker.sources.deletion_cost_api import FIELD_MANAGER, PodGone, self_review
from picker.sources.kube import ApiFailure, BadData, Disconnected, SourceError
from picker.sources.kube_api import InferencePool, make_client

_MAX_ANSWER = 4 * 1024 * 1024


class StatusConflict(SourceError):
    """Someone wrote the pool between this picker's read and its write (409): read again."""

    kind = "conflict"


class LightkubePoolStatusApi:
    """The InferencePool's status subresource and the namespace's events."""

    def __init__(self, config: KubeConfig, *, namespace: str | None, request_timeout_s: float) -> None:
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace

    async def may(self, verb: str, resource: str, group: str, subresource: str = "") -> tuple[bool, str]:
        """Whether this picker may `verb` that resource in its namespace; SourceError: cannot tell."""
        return await self_review(self._client, verb, resource, group, self.namespace, subresource)

    async def read(self, name: str) -> tuple[list[Mapping[str, Any]], str, str, int, Mapping[str, Any]]:
        """The pool's `status.parents`, its resourceVersion, uid, generation and spec."""
        request = self._client.prepare_request("get", InferencePool, name=name, namespace=self.namespace)
        pool = await self._send(request, f"get inferencepool {name}")
        meta = pool.get("metadata") if isinstance(pool.get("metadata"), dict) else {}
        status = pool.get("status") if isinstance(pool.get("status"), dict) else {}
        parents = status.get("parents") or []
        if not isinstance(parents, list) or not all(isinstance(p, dict) for p in parents):
            raise BadData(f"inferencepool {name}: status.parents is not a list of objects")
        version, uid = meta.get("resourceVersion"), meta.get("uid")
        if not isinstance(version, str) or not version:
            raise BadData(f"inferencepool {name}: no metadata.resourceVersion")
        generation = meta.get("generation")
        spec = pool.get("spec") if isinstance(pool.get("spec"), dict) else {}
        return (
            parents,
            version,
            uid if isinstance(uid, str) else "",
            generation if isinstance(generation, int) and not isinstance(generation, bool) else 0,
            spec,
        )

    async def write(self, name: str, parents: list[Mapping[str, Any]], version: str) -> str:
        """`status.parents` replaced, if the pool is still at `version`: its new resourceVersion.
        StatusConflict when it is not, PodGone (kind "gone") when the pool is gone."""
        request = self._client.prepare_request(
            "patch",
            InferencePool.Status,
            name=name,
            namespace=self.namespace,
            obj={"metadata": {"resourceVersion": version}, "status": {"parents": parents}},
            headers={"Content-Type": PatchType.MERGE.value},
            params={"fieldManager": FIELD_MANAGER},
        )
        pool = await self._send(request, f"patch inferencepool {name}/status", writing=True)
        written = (pool.get("metadata") or {}).get("resourceVersion")
        return written if isinstance(written, str) else ""

    async def record(self, event: Mapping[str, Any]) -> None:
        """Create one events.k8s.io/v1 Event (its body whole, metadata included)."""
        request = self._client.prepare_request(
            "post", Event, obj=Event.from_dict(dict(event)), namespace=self.namespace
        )
        await self._send(request, "create event", writing=True)

    async def _send(self, request: Any, what: str, *, writing: bool = False) -> dict[str, Any]:
        try:
            response = await self._client.send(self._client.build_adapter_request(request))
            try:
                body = await response.aread()
            finally:
                await response.aclose()
        except httpx2.HTTPError as exc:
            raise Disconnected(f"{what}: {type(exc).__name__}: {exc}") from None
        code = response.status_code
        if code == 404:
            raise PodGone(f"{what}: HTTP 404")
        if code == 409 and writing:
            raise StatusConflict(f"{what}: HTTP 409 (written meanwhile)")
        if code >= 300:
            hint = f": the picker needs this permission in {self.namespace}" if code == 403 else ""
            raise ApiFailure(f"{what}: HTTP {code}{hint}{_detail(body)}")
        if len(body) > _MAX_ANSWER:
            raise BadData(f"{what}: a {len(body)}-byte answer")
        try:
            answer = json.loads(body)
        except ValueError:
            raise BadData(f"{what}: undecodable answer ({len(body)} bytes)") from None
        if not isinstance(answer, dict):
            raise BadData(f"{what}: the answer is not an object")
        return answer

    async def aclose(self) -> None:
        await self._client.close()


def _detail(body: bytes) -> str:
    """The Status message of an error answer, shortened (it names what was refused and why)."""
    try:
        message = json.loads(body[:65536]).get("message")
    except (ValueError, AttributeError):
        return ""
    return f" ({str(message)[:300]})" if message else ""
