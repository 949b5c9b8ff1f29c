"""The fake API server's reviews, answered as kube-apiserver answers them (a mixin of FakeApiServer).

- POST /apis/authentication.k8s.io/v1/tokenreviews: `status.authenticated` with `status.user`
  (username, uid, the service-account groups) and `audiences` for a token one of the server's clients
  holds (`add_token`); otherwise `status.user: {}` and an `error`, without `authenticated`.
- POST /apis/authorization.k8s.io/v1/subjectaccessreviews: the spec validated as the real one does
  (a user or groups; exactly one of resourceAttributes and nonResourceAttributes; else HTTP 422
  Invalid); `status.allowed: true` with RBAC's reason when a grant (`grant`) names the user or one of
  its groups for that non-resource path and verb (a path ending in `*` is a prefix, `*` any verb),
  `status.allowed: false` without a reason otherwise (RBAC never denies, it only does not allow), or
  `allowed: false, denied: true` with the reason for a user `deny` names (an authorizer webhook's
  explicit denial). Resource attributes are never allowed here.
The caller must present a client's token itself (401 otherwise). Each review answered is counted
(`token_reviews`, `access_reviews`) when it arrives; `hold_reviews()` keeps every review waiting
until the event it returns is set; `fail_next(n, code, resource="tokenreviews" | "subjectaccessreviews")`.
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import Any

from aiohttp import web

from tests.kube.kube_objects import SERVICE_ACCOUNT_GROUPS, status_response

JSON = "application/json"
AUTHENTICATION = "/apis/authentication.k8s.io/v1/tokenreviews"
AUTHORIZATION = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


class ReviewsMixin:
    """Token and access reviews over the server's clients (`tokens`) and the grants a test makes."""

    tokens: set[str]
    _failures: list[tuple[int, str | None]]

    def _authorized(self, request: web.Request) -> bool: ...

    def _init_reviews(self) -> None:
        self.token_reviews = 0
        self.access_reviews = 0
        self.access_specs: list[dict[str, Any]] = []  # what each SubjectAccessReview asked
        self._grants: set[tuple[str, str, str]] = set()  # (user or group, path, verb)
        self._denials: dict[str, str] = {}  # user -> reason
        self._held: asyncio.Event | None = None

    def _add_review_routes(self, app: web.Application) -> None:
        app.router.add_post(AUTHENTICATION, self._token_review)
        app.router.add_post(AUTHORIZATION, self._access_review)

    # -- test controls -----------------------------------------------------------------------------

    @staticmethod
    def user_of(token: str) -> str:
        """The service account a client's token authenticates as."""
        return f"system:serviceaccount:default:client-{hashlib.sha256(token.encode()).hexdigest()[:8]}"

    def grant(self, subject: str, path: str = "/metrics", verb: str = "get") -> None:
        """What a ClusterRole with `nonResourceURLs: [path]`, `verbs: [verb]` bound to `subject` (a
        user, or a group) allows."""
        self._grants.add((subject, path, verb))

    def deny(self, user: str, reason: str = "denied by the authorization webhook") -> None:
        self._denials[user] = reason

    def hold_reviews(self) -> asyncio.Event:
        """Every review waits, once counted, until the returned event is set."""
        self._held = asyncio.Event()
        return self._held

    # -- protocol ----------------------------------------------------------------------------------

    def _refused(self, request: web.Request, plural: str) -> web.Response | None:
        if not self._authorized(request):
            return status_response(401, "Unauthorized", "Unauthorized")
        failure = next((f for f in self._failures if f[1] in (None, plural)), None)
        if failure is not None:
            self._failures.remove(failure)
            return status_response(failure[0], "InternalError", f"injected {failure[0]}")
        return None

    async def _token_review(self, request: web.Request) -> web.Response:
        refused = self._refused(request, "tokenreviews")
        if refused is not None:
            return refused
        body = await request.json()
        token = ((body or {}).get("spec") or {}).get("token", "")
        self.token_reviews += 1
        if self._held is not None:
            await self._held.wait()
        answer: dict[str, Any]
        if token in self.tokens:
            name = self.user_of(token)
            answer = {
                "authenticated": True,
                "user": {"username": name, "uid": f"uid-{name[-8:]}", "groups": list(SERVICE_ACCOUNT_GROUPS)},
                "audiences": ["https://kubernetes.default.svc"],
            }
        else:
            answer = {"user": {}, "error": "[invalid bearer token, token lookup failed]"}
        return web.json_response(
            {**body, "metadata": {"creationTimestamp": None}, "status": answer}, status=201
        )

    async def _access_review(self, request: web.Request) -> web.Response:
        refused = self._refused(request, "subjectaccessreviews")
        if refused is not None:
            return refused
        body = await request.json()
        spec = (body or {}).get("spec") or {}
        user, groups = spec.get("user") or "", list(spec.get("groups") or [])
        resource, non_resource = spec.get("resourceAttributes"), spec.get("nonResourceAttributes")
        errors = []
        if not user and not groups:
            errors.append('spec.user: Invalid value: "": at least one of user or group must be specified')
        if (resource is None) == (non_resource is None):
            errors.append(
                'spec.resourceAttributes: Invalid value: "null": exactly one of nonResourceAttributes '
                "or resourceAttributes must be specified"
            )
        if errors:
            message = f'SubjectAccessReview.authorization.k8s.io "" is invalid: [{", ".join(errors)}]'
            return status_response(422, "Invalid", message)
        self.access_reviews += 1
        self.access_specs.append(spec)
        if self._held is not None:
            await self._held.wait()
        answer: dict[str, Any] = {"allowed": False}
        if user in self._denials:
            answer = {"allowed": False, "denied": True, "reason": self._denials[user]}
        elif non_resource is not None:
            path, verb = str(non_resource.get("path", "")), str(non_resource.get("verb", ""))
            for subject in (user, *groups):
                if any(self._allows(grant, subject, path, verb) for grant in self._grants):
                    reason = (
                        f'RBAC: allowed by ClusterRoleBinding "readers" of ClusterRole "reader" to {subject}'
                    )
                    answer = {"allowed": True, "reason": reason}
                    break
        return web.json_response(
            {**body, "metadata": {"creationTimestamp": None}, "status": answer}, status=201
        )

    @staticmethod
    def _allows(grant: tuple[str, str, str], subject: str, path: str, verb: str) -> bool:
        who, allowed_path, allowed_verb = grant
        path_ok = allowed_path == path or (allowed_path.endswith("*") and path.startswith(allowed_path[:-1]))
        return who == subject and path_ok and allowed_verb in (verb, "*")
