"""What a reader's bearer token is worth on the metrics port (admin.metrics_auth): the verdict of
the API server's TokenReview and SubjectAccessReview (picker/sources/token_review.py), as the admin
API's handlers answer it. Apart from the reviewer so the admin API needs no Kubernetes client."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable


class Access(enum.Enum):
    """One token's verdict (closed set); the HTTP status it gets."""

    ALLOWED = "allowed"  # a real identity, allowed to `get` the non-resource URL /metrics: 200
    UNAUTHENTICATED = "unauthenticated"  # no identity the API server vouches for: 401
    FORBIDDEN = "forbidden"  # a real identity, not allowed: 403
    UNREVIEWED = "unreviewed"  # the API server could not be asked (down, slow, too many at once): 503


Reviewer = Callable[[str], Awaitable[Access]]
