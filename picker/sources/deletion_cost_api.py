"""The pod-deletion-cost annotation over lightkube: may this picker patch pods (a SelfSubjectAccessReview),
and one annotation on one pod (a JSON merge patch of `metadata.annotations`, nothing else).

The patch names the pod's uid when its source knows it: the API server refuses it (409, a
precondition) should the name now belong to another pod, so a value meant for one pod never lands
on its successor. Library exceptions are mapped to the writer's errors here, in one place.
"""

from __future__ import annotations

from typing import Any

import httpx2
import msgspec
from lightkube.config.kubeconfig import KubeConfig
from lightkube.core.generic_client import GenericAsyncClient
from lightkube.models.authorization_v1 import ResourceAttributes, SelfSubjectAccessReviewSpec
from lightkube.resources.authorization_v1 import SelfSubjectAccessReview
from lightkube.resources.core_v1 import Pod
from lightkube.types import PatchType

from picker.pool.deletion_cost import ANNOTATION, PodRef
from picker.sources.kube import ApiFailure, Disconnected, ReviewNotServed, SourceError
from picker.sources.kube_api import make_client

FIELD_MANAGER = "inference-picker"


class PodGone(SourceError):
    """The pod is gone, or its name belongs to another pod now (404, or the uid precondition's 409)."""

    kind = "gone"


class Forbidden(ApiFailure):
    """The API server refused the write (403): this identity may not make it."""

    kind = "forbidden"


async def self_review(
    client: GenericAsyncClient, verb: str, resource: str, group: str, namespace: str, subresource: str = ""
) -> tuple[bool, str]:
    """Whether this picker's identity may `verb` the resource (a SelfSubjectAccessReview), and the API
    server's reason. SourceError when the review cannot be made (the API server down or refusing it);
    ReviewNotServed when the API server does not serve the review at all."""
    attributes = ResourceAttributes(
        verb=verb, resource=resource, group=group, namespace=namespace, subresource=subresource or None
    )
    review = SelfSubjectAccessReview(spec=SelfSubjectAccessReviewSpec(resourceAttributes=attributes))
    try:
        answer: Any = await client.request("post", obj=review)
    except httpx2.HTTPStatusError as exc:
        code = exc.response.status_code
        failure = ReviewNotServed if code == 404 else ApiFailure
        raise failure(f"selfsubjectaccessreview: HTTP {code}") from None
    except httpx2.HTTPError as exc:
        raise Disconnected(f"selfsubjectaccessreview: {type(exc).__name__}: {exc}") from None
    except msgspec.MsgspecError as exc:
        raise ApiFailure(f"selfsubjectaccessreview: undecodable answer: {exc}") from None
    status = answer.status
    allowed = status is not None and status.allowed is True and not status.denied
    reason = (status.reason or status.evaluationError or "") if status is not None else ""
    return allowed, reason[:300]


class LightkubePodPatcher:
    """Patches the deletion-cost annotation of the pool's pods; asks whether it may."""

    def __init__(self, config: KubeConfig, *, namespace: str | None, request_timeout_s: float) -> None:
        self._client = make_client(config, namespace, request_timeout_s)
        self.namespace: str = self._client.namespace

    async def may_patch(self, namespace: str) -> tuple[bool, str]:
        """Whether this picker's identity may patch pods in `namespace`, and the API server's reason.
        SourceError when the review cannot be made (the API server down or refusing it)."""
        return await self_review(self._client, "patch", "pods", "", namespace)

    async def annotate(self, pod: PodRef, value: int) -> None:
        """Set the pod's annotation to `value`: PodGone, Forbidden, ApiFailure or Disconnected when it
        did not. The answer (the whole pod) is not decoded: a field the client library's model does not know
        must not turn a write that went through into one that seems to have failed (and is repeated)."""
        metadata: dict[str, Any] = {"annotations": {ANNOTATION: str(value)}}
        if pod.uid is not None:
            metadata["uid"] = pod.uid  # a precondition: this pod, not a successor of the same name
        request = self._client.prepare_request(
            "patch",
            Pod,
            name=pod.name,
            namespace=pod.namespace,
            obj={"metadata": metadata},
            headers={"Content-Type": PatchType.MERGE.value},
            params={"fieldManager": FIELD_MANAGER},
        )
        try:
            response = await self._client.send(self._client.build_adapter_request(request))
            await response.aclose()
        except httpx2.HTTPError as exc:
            raise Disconnected(f"patch pod {pod.key}: {type(exc).__name__}: {exc}") from None
        code = response.status_code
        if code in (404, 409):
            raise PodGone(f"pod {pod.key}: HTTP {code}")
        if code == 403:
            raise Forbidden(
                f"patch pod {pod.key}: HTTP 403: the picker needs patch on pods in {pod.namespace}"
            )
        if code >= 300:
            raise ApiFailure(f"patch pod {pod.key}: HTTP {code}")

    async def aclose(self) -> None:
        await self._client.close()
