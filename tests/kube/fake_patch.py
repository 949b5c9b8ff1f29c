"""The fake API server's PATCH and self access reviews, as kube-apiserver answers them (a mixin of
FakeApiServer).

- PATCH {collection}/{name} with `Content-Type: application/merge-patch+json` (RFC 7386: objects
  merge key by key, `null` removes a key, anything else replaces): the object at a new
  resourceVersion, a MODIFIED event for every watch; `generation` moves only when `spec` changed,
  as the API server's does. What the real one refuses, this refuses the same way: a body that is not
  a JSON object (400 BadRequest), another patch type (415 UnsupportedMediaType: strategic merge and
  apply are not implemented here), no such object (404), `metadata.name` other than the URL's (400),
  `metadata.uid` or `metadata.resourceVersion` other than the object's (409 Conflict: preconditions),
  a pod whose `controller.kubernetes.io/pod-deletion-cost` is not an int32 (422 Invalid).
- The status subresource of the resources that have one (`STATUS_SUBRESOURCE`: InferencePools, as
  their CRD declares `subresources: status`): PATCH and GET on {collection}/{name}/status; a PATCH
  there changes `status` alone (anything else in it is ignored), a PATCH of the object itself leaves
  `status` as it was; RBAC asks for `<plural>/status`. An InferencePool's status is checked against
  the v1 CRD's schema (422 Invalid): at most 32 parents, each with a parentRef naming something, at
  most 8 conditions, each with type, status True/False/Unknown, a CamelCase reason,
  lastTransitionTime and a message of at most 32768 characters, one per type.
- POST /apis/authorization.k8s.io/v1/selfsubjectaccessreviews: exactly one of resourceAttributes
  and nonResourceAttributes (422 otherwise); `status.allowed` for the caller's own identity (a
  subresource is asked as `<resource>/<subresource>`, as RBAC rules name it).
RBAC: none by default (every client may do anything, as with the other routes); once a test calls
`rbac()`, a PATCH needs a grant (`grant_resource(subject, verb, resource, group, namespace)` for the
client's user or one of its groups; 403 Forbidden otherwise) and a self review says what the grants
allow. `patches` logs each PATCH answered (namespace, name, body, status, time.monotonic() at).
"""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Iterator
from typing import Any

from aiohttp import web

from tests.kube.kube_objects import RESOURCES, SERVICE_ACCOUNT_GROUPS, status_response

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
SELF_REVIEW = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
STATUS_SUBRESOURCE = frozenset({"inferencepools"})
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _int32(text: Any) -> bool:
    try:
        return isinstance(text, str) and -(2**31) <= int(text, 10) < 2**31
    except ValueError:
        return False


class PatchMixin:
    """PATCH on every collection, and self access reviews, for FakeApiServer."""

    tokens: set[str]
    _objects: dict[tuple[str, str, str], dict[str, Any]]
    _failures: list[tuple[int, str | None]]
    requests: list[dict[str, Any]]

    _rv: Iterator[int]

    def _authorized(self, request: web.Request) -> bool: ...
    def _record(self, rv: int, kind: str, obj: dict[str, Any], previous: dict[str, Any] | None) -> None: ...
    @staticmethod
    def user_of(token: str) -> str: ...

    def _init_patch(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.self_reviews: list[dict[str, Any]] = []  # what each SelfSubjectAccessReview asked
        self._rbac = False
        self._resource_grants: set[tuple[str, str, str, str, str]] = set()

    def _add_patch_routes(self, app: web.Application) -> None:
        for plural, (path, _, _) in RESOURCES.items():
            app.router.add_patch(f"{path}/namespaces/{{namespace}}/{plural}/{{name}}", self._patch)
            if plural in STATUS_SUBRESOURCE:
                one = f"{path}/namespaces/{{namespace}}/{plural}/{{name}}/status"
                app.router.add_patch(one, self._patch)
                app.router.add_get(one, self._get_status)
        app.router.add_post(SELF_REVIEW, self._self_review)

    # -- test controls -----------------------------------------------------------------------------

    def rbac(self) -> None:
        """From now on only what `grant_resource` grants is allowed (PATCH and self reviews)."""
        self._rbac = True

    def grant_resource(
        self, subject: str, verb: str, resource: str, group: str = "", namespace: str = "default"
    ) -> None:
        """What a Role with that rule, bound to `subject` (a user or a group), allows."""
        self._resource_grants.add((subject, verb, group, resource, namespace))

    def patched(self, name: str, status_code: int = 200) -> list[dict[str, Any]]:
        """The bodies of the PATCHes of `name` answered with `status_code`."""
        return [p["body"] for p in self.patches if p["name"] == name and p["status"] == status_code]

    # -- protocol ----------------------------------------------------------------------------------

    def _bearer(self, request: web.Request) -> str:
        return request.headers.get("Authorization", "")[len("Bearer ") :]

    def _may(self, token: str, verb: str, group: str, resource: str, namespace: str) -> bool:
        if not self._rbac:
            return True
        subjects = (self.user_of(token), *SERVICE_ACCOUNT_GROUPS)
        return any(
            (who, verb, group, resource, namespace) in self._resource_grants
            or (who, "*", group, resource, namespace) in self._resource_grants
            for who in subjects
        )

    async def _get_status(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        plural = request.path.split("/namespaces/", 1)[1].split("/")[1]
        self.requests.append({"method": "GET", "path": request.path, "query": dict(request.query)})
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        current = self._objects.get((plural, namespace, name))
        if current is None:
            return status_response(404, "NotFound", f'{plural} "{name}" not found')
        return web.Response(body=json.dumps(current), content_type=JSON)

    async def _patch(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        plural = request.path.split("/namespaces/", 1)[1].split("/")[1]
        self.requests.append({"method": "PATCH", "path": request.path, "query": dict(request.query)})
        try:
            body: Any = json.loads(await request.read() or b"null")
        except ValueError:
            body = None
        answer = self._patch_answer(request, plural, namespace, name, body)
        self.patches.append(
            {
                "namespace": namespace,
                "name": name,
                "body": body,
                "status": answer.status,
                "at": time.monotonic(),
                "subresource": "status" if request.path.endswith("/status") else "",
            }
        )
        return answer

    def _patch_answer(
        self, request: web.Request, plural: str, namespace: str, name: str, body: Any
    ) -> web.Response:
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        failure = next((f for f in self._failures if f[1] in (None, plural)), None)
        if failure is not None:
            self._failures.remove(failure)
            return status_response(failure[0], "InternalError", f"injected {failure[0]}")
        group = RESOURCES[plural][2].rpartition("/")[0]
        on_status = plural in STATUS_SUBRESOURCE and request.path.endswith("/status")
        rbac_resource = f"{plural}/status" if on_status else plural
        if not self._may(self._bearer(request), "patch", group, rbac_resource, namespace):
            user = self.user_of(self._bearer(request))
            return status_response(
                403,
                "Forbidden",
                f'{plural} "{name}" is forbidden: User "{user}" cannot patch resource "{rbac_resource}" '
                f'in API group "{group}" in the namespace "{namespace}"',
            )
        if request.content_type != MERGE_PATCH:
            return status_response(
                415,
                "UnsupportedMediaType",
                f"the body of the request was in an unknown format - {request.content_type}",
            )
        if not isinstance(body, dict):
            return status_response(400, "BadRequest", "the patch is not a JSON object")
        current = self._objects.get((plural, namespace, name))
        if current is None:
            return status_response(404, "NotFound", f'{plural} "{name}" not found')
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        if "name" in meta and meta["name"] != name:
            return status_response(
                400,
                "BadRequest",
                f"the name of the object ({meta['name']}) does not match the name on the URL ({name})",
            )
        for precondition, field in (("UID", "uid"), ("ResourceVersion", "resourceVersion")):
            if field in meta and meta[field] != current["metadata"].get(field):
                return status_response(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {plural} "{name}": Precondition failed: '
                    f"{precondition} in precondition: {meta[field]}, {precondition} in object meta: "
                    f"{current['metadata'].get(field)}",
                )
        updated = merge_patch(current, body)
        if on_status:  # the status subresource: status alone changes
            updated = {**copy.deepcopy(current), "status": updated.get("status")}
            if updated["status"] is None:
                updated.pop("status")
            invalid = _invalid_pool_status(updated.get("status")) if plural == "inferencepools" else None
            if invalid is not None:
                return status_response(
                    422,
                    "Invalid",
                    f'InferencePool.inference.networking.k8s.io "{name}" is invalid: {invalid}',
                )
        elif plural in STATUS_SUBRESOURCE:  # the object itself: its status is not changed here
            updated.pop("status", None)
            if "status" in current:
                updated["status"] = copy.deepcopy(current["status"])
        cost = ((updated.get("metadata") or {}).get("annotations") or {}).get(DELETION_COST)
        if plural == "pods" and cost is not None and not _int32(cost):
            return status_response(
                422,
                "Invalid",
                f'Pod "{name}" is invalid: metadata.annotations[{DELETION_COST}]: Invalid value: '
                f'"{cost}": must be a 32bit integer',
            )
        rv = next(self._rv)
        updated["metadata"].update(
            name=name,
            namespace=namespace,
            uid=current["metadata"]["uid"],
            resourceVersion=str(rv),
            generation=current["metadata"]["generation"] + (updated.get("spec") != current.get("spec")),
        )
        self._objects[(plural, namespace, name)] = updated
        self._record(rv, "MODIFIED", updated, current)
        return web.Response(body=json.dumps(updated), content_type=JSON)

    async def _self_review(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        failure = next((f for f in self._failures if f[1] in (None, "selfsubjectaccessreviews")), None)
        if failure is not None:
            self._failures.remove(failure)
            return status_response(failure[0], "InternalError", f"injected {failure[0]}")
        body = await request.json()
        spec = (body or {}).get("spec") or {}
        resource, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        if (resource is None) == (non_resource is None):
            return status_response(
                422,
                "Invalid",
                'SelfSubjectAccessReview.authorization.k8s.io "" is invalid: spec.resourceAttributes: '
                'Invalid value: "null": exactly one of nonResourceAttributes or resourceAttributes '
                "must be specified",
            )
        self.self_reviews.append(spec)
        token = self._bearer(request)
        if resource is not None:
            asked = str(resource.get("resource", ""))
            if resource.get("subresource"):
                asked = f"{asked}/{resource['subresource']}"
            allowed = self._may(
                token,
                str(resource.get("verb", "")),
                str(resource.get("group", "")),
                asked,
                str(resource.get("namespace", "")),
            )
        else:
            allowed = not self._rbac
        answer: dict[str, Any] = {"allowed": allowed}
        if allowed and self._rbac:
            answer["reason"] = (
                f'RBAC: allowed by RoleBinding "grants" of Role "grants" to {self.user_of(token)}'
            )
        return web.json_response(
            {**body, "metadata": {"creationTimestamp": None}, "status": answer}, status=201
        )


def _invalid_pool_status(status: Any) -> str | None:
    """What the v1 InferencePool CRD's schema refuses in a status, as the API server words it; None: valid."""
    if status is None:
        return None
    if not isinstance(status, dict):
        return "status: Invalid value: must be an object"
    parents = status.get("parents", [])
    if not isinstance(parents, list):
        return "status.parents: Invalid value: must be a list"
    if len(parents) > 32:
        return f"status.parents: Too many: {len(parents)}: must have at most 32 items"
    for i, parent in enumerate(parents):
        where = f"status.parents[{i}]"
        ref = parent.get("parentRef") if isinstance(parent, dict) else None
        if not isinstance(ref, dict) or not ref.get("name"):
            return f"{where}.parentRef.name: Required value"
        conditions = parent.get("conditions", [])
        if not isinstance(conditions, list) or len(conditions) > 8:
            return f"{where}.conditions: Too many: must have at most 8 items"
        types: set[str] = set()
        for j, condition in enumerate(conditions):
            at = f"{where}.conditions[{j}]"
            if not isinstance(condition, dict):
                return f"{at}: Invalid value: must be an object"
            for key in ("type", "status", "reason", "message", "lastTransitionTime"):
                if not isinstance(condition.get(key), str):
                    return f"{at}.{key}: Required value"
            if condition["status"] not in ("True", "False", "Unknown"):
                return f'{at}.status: Unsupported value: "{condition["status"]}"'
            if not _REASON.match(condition["reason"]) or len(condition["reason"]) > 1024:
                return f'{at}.reason: Invalid value: "{condition["reason"]}"'
            if len(condition["message"]) > 32768:
                return f"{at}.message: Too long: may not be more than 32768 bytes"
            if condition["type"] in types:
                return f'{at}: Duplicate value: map[string]interface {{}}{{"type":"{condition["type"]}"}}'
            types.add(condition["type"])
    return None
