"""Who may read `/metrics` (admin.metrics_auth) and, with admin.read_auth `metrics`, the admin API's
reads: as the reference picker's `--metrics-endpoint-auth` (controller-runtime's
WithAuthenticationAndAuthorization), a bearer token the API server vouches for in a TokenReview
(authentication.k8s.io/v1), whose user it then allows to `get` the non-resource URL `/metrics` in a
SubjectAccessReview (authorization.k8s.io/v1). Authenticated is not enough: any service account in
the cluster is authenticated.

Prometheus presents its service account's token on every scrape, so verdicts are cached by the
token's SHA-256 (never the token): an allowed one for `allow_cache_s` (at most `allowed_cached`
tokens), a refused one (unauthenticated or forbidden) for `deny_cache_s` (at most `denied_cached`),
apart, so a flood of made-up tokens evicts only refusals. Requests that present the same token while
its review runs share that one review (a single flight); at most `_FLIGHTS` reviews run at once,
and a token beyond them is answered 503 unreviewed. A review that fails (the API server down or
slow) is a refusal, never an open door, and is not cached.

The RBAC this needs (config/k8s/metrics-auth): `create` on `tokenreviews` and on
`subjectaccessreviews`, both cluster-scoped, so a ClusterRole bound by a ClusterRoleBinding (the
reference chart's); each reader: `get` on the nonResourceURL `/metrics` (a ClusterRole too).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.models.authorization_v1 import NonResourceAttributes, SubjectAccessReviewSpec
from lightkube.resources.authentication_v1 import TokenReview
from lightkube.resources.authorization_v1 import SubjectAccessReview

from picker.sources.access import Access
from picker.sources.kube_api import load_kubeconfig

log = logging.getLogger(__name__)

PATH, VERB = "/metrics", "get"  # what a reader must be allowed, as the reference asks
_FLIGHTS = 64


class _Verdicts:
    """Verdicts by token digest until they expire; the oldest go first beyond `size`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._until: OrderedDict[str, tuple[Access, float]] = OrderedDict()

    def get(self, key: str, now: float) -> Access | None:
        found = self._until.get(key)
        if found is None:
            return None
        if found[1] <= now:
            del self._until[key]
            return None
        return found[0]

    def put(self, key: str, access: Access, until: float) -> None:
        self._until[key] = (access, until)
        self._until.move_to_end(key)
        while len(self._until) > self.size:
            self._until.popitem(last=False)

    def __len__(self) -> int:
        return len(self._until)


class TokenReviewer:
    """Asks the API server who a bearer token is and whether it may read; caches the verdicts."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        allow_cache_s: float = 60.0,
        deny_cache_s: float = 30.0,
        allowed_cached: int = 256,
        denied_cached: int = 1024,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = AsyncClient(config=config, timeout=timeout_s)
        self._allow_s, self._deny_s = allow_cache_s, deny_cache_s
        self._allowed, self._denied = _Verdicts(allowed_cached), _Verdicts(denied_cached)
        self._clock = clock
        self._flights: dict[str, asyncio.Task[Access]] = {}
        self.joined = 0  # requests that shared a review already under way
        self.reviews: Counter[tuple[str, str]] = Counter()  # (tokenreview | subjectaccessreview, result)

    @classmethod
    def of(cls, kubeconfig: Path | None) -> TokenReviewer:
        """Over the kubeconfig at that path (None: the pod's service account, or $KUBECONFIG)."""
        return cls(load_kubeconfig(kubeconfig))

    async def review(self, token: str) -> Access:
        """The token's verdict: cached, the review under way for it, or a new review."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        cached = self._allowed.get(key, now) or self._denied.get(key, now)
        if cached is not None:
            return cached
        flight = self._flights.get(key)
        if flight is not None:
            self.joined += 1
        else:
            if len(self._flights) >= _FLIGHTS:
                log.warning("metrics auth: %d reviews under way already; refused unreviewed", _FLIGHTS)
                return Access.UNREVIEWED
            flight = asyncio.get_running_loop().create_task(self._decide(key, token))
            self._flights[key] = flight
            flight.add_done_callback(lambda _: self._flights.pop(key, None))
        return await asyncio.shield(flight)  # a caller that goes away leaves the others' review running

    async def _decide(self, key: str, token: str) -> Access:
        try:
            access = await self._ask(token)
        except Exception as exc:  # the API server down or refusing: nobody gets in meanwhile
            log.warning("metrics auth: a review failed (%s); refused", type(exc).__name__)
            return Access.UNREVIEWED
        if access is Access.ALLOWED:
            self._allowed.put(key, access, self._clock() + self._allow_s)
        else:
            self._denied.put(key, access, self._clock() + self._deny_s)
        return access

    async def _ask(self, token: str) -> Access:
        try:
            who = await self._client.create(TokenReview(spec=TokenReviewSpec(token=token)))
        except Exception:
            self.reviews["tokenreview", "failed"] += 1
            raise
        status = who.status
        user = status.user if status is not None and status.authenticated else None
        if user is None or not (user.username or user.groups):
            self.reviews["tokenreview", "unauthenticated"] += 1
            return Access.UNAUTHENTICATED
        self.reviews["tokenreview", "authenticated"] += 1
        spec = SubjectAccessReviewSpec(
            user=user.username,
            groups=user.groups,
            uid=user.uid,
            extra=user.extra,
            nonResourceAttributes=NonResourceAttributes(path=PATH, verb=VERB),
        )
        try:
            may = await self._client.create(SubjectAccessReview(spec=spec))
        except Exception:
            self.reviews["subjectaccessreview", "failed"] += 1
            raise
        verdict = may.status
        allowed = verdict is not None and verdict.allowed is True and not verdict.denied
        self.reviews["subjectaccessreview", "allowed" if allowed else "denied"] += 1
        if not allowed:
            reason = (verdict.reason if verdict is not None else None) or "no RBAC rule allows it"
            log.info("metrics auth: %s may not get %s (%s)", user.username, PATH, reason[:200])
        return Access.ALLOWED if allowed else Access.FORBIDDEN

    async def aclose(self) -> None:
        flights = list(self._flights.values())
        for flight in flights:
            flight.cancel()  # its own reviews: nobody else waits once the port is closed
        await asyncio.gather(*flights, return_exceptions=True)
        await self._client.close()
