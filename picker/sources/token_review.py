"""Who may read `/metrics` (admin.metrics_auth): a bearer token the API server vouches for, as the
reference picker's `--metrics-endpoint-auth` does (a TokenReview, authentication.k8s.io/v1).

Prometheus presents its service account's token on every scrape; each distinct token is reviewed
once and the answer kept for `cache_s` (a scrape every 15 s must not cost the API server a review
each), at most `_CACHED` tokens (only their SHA-256, never the token). The RBAC this needs: `create`
on `tokenreviews` (a ClusterRole: the reference chart's). A review that fails (API server down) is
a refusal, never an open door; it is not cached.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from lightkube import AsyncClient
from lightkube.config.kubeconfig import KubeConfig
from lightkube.models.authentication_v1 import TokenReviewSpec
from lightkube.resources.authentication_v1 import TokenReview

log = logging.getLogger(__name__)

_CACHED = 256


class TokenReviewer:
    """Asks the API server whether a bearer token is a real identity; caches the verdicts."""

    def __init__(
        self,
        config: KubeConfig,
        *,
        cache_s: float = 60.0,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = AsyncClient(config=config, timeout=timeout_s)
        self._cache_s = cache_s
        self._clock = clock
        self._verdicts: OrderedDict[str, tuple[bool, float]] = OrderedDict()  # sha256 -> (ok, until)
        self.reviews = 0
        self.failures = 0

    async def authenticated(self, token: str) -> bool:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        cached = self._verdicts.get(key)
        if cached is not None and cached[1] > now:
            return cached[0]
        try:
            self.reviews += 1
            review = await self._client.create(TokenReview(spec=TokenReviewSpec(token=token)))
        except Exception as exc:  # the API server down or refusing: nobody gets in meanwhile
            self.failures += 1
            log.warning("metrics auth: the TokenReview failed (%s); refused", type(exc).__name__)
            return False
        ok = bool(review.status is not None and review.status.authenticated)
        self._verdicts[key] = (ok, now + self._cache_s)
        self._verdicts.move_to_end(key)
        while len(self._verdicts) > _CACHED:
            self._verdicts.popitem(last=False)
        return ok

    async def aclose(self) -> None:
        await self._client.close()
