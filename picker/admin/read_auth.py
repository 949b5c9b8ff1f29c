"""Who may read the metrics port: `/metrics`, and with admin.read_auth `metrics` (the default) the
admin API's reads (`/admin/status`, `/admin/endpoints[/<addr>]`, `/admin/drains`, `/admin/rollout`,
`/admin/tenants`).

Nothing is asked while neither admin.metrics_token nor admin.metrics_auth is set (the port as it
always was). Once one is, a reader presents the static metrics token (compared in constant time) or
a bearer token the API server authenticates (TokenReview) and allows to `get` the non-resource URL
`/metrics` (SubjectAccessReview; picker/sources/token_review.py): 401 without one, 403 for an
identity RBAC does not allow, 503 when the API server cannot be asked. An admin read is also open
to a caller who may change state: the admin token, or loopback where that is enough (no admin
token, or admin.trust_loopback), from a Host that is an IP literal or localhost, so a web page a
DNS name rebound to 127.0.0.1 serves cannot read the port through a port-forward.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Awaitable, Callable
from typing import assert_never

from aiohttp import web

from picker.admin.browser import literal_host
from picker.sources.access import Access, Reviewer

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_LONGEST = 16384  # a bearer token longer than this is not one (a service account's is ~1 KB)


class ReadGuard:
    """The rule for reads, over the configured tokens and the reviewer."""

    def __init__(
        self,
        metrics_token: str | None,
        reviewer: Reviewer | None,
        *,
        admin_token: str | None,
        trust_loopback: bool,
    ) -> None:
        self.metrics_token, self.reviewer = metrics_token, reviewer
        self.admin_token, self.trust_loopback = admin_token, trust_loopback

    def wrap(self, handler: Handler) -> Handler:
        """One of the admin API's reads, under this rule."""

        async def guarded(request: web.Request) -> web.StreamResponse:
            refused = await self.refusal(request, admin_may=True)
            return refused if refused is not None else await handler(request)

        return guarded

    async def refusal(self, request: web.Request, *, admin_may: bool) -> web.Response | None:
        """None when the caller may read; else the answer that says why not. `admin_may`: an admin
        read, which a caller who may change state may make too."""
        if self.metrics_token is None and self.reviewer is None:
            return None
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        presented = presented.strip() if scheme.lower() == "bearer" and len(presented) <= _LONGEST else ""
        if admin_may and self._may_change(request, presented):
            return None
        if _same(presented, self.metrics_token):
            return None
        reviewer = self.reviewer
        access = await reviewer(presented) if reviewer is not None and presented else Access.UNAUTHENTICATED
        match access:
            case Access.ALLOWED:
                return None
            case Access.UNAUTHENTICATED:
                return error(401, f"{request.path} needs a bearer token", {"WWW-Authenticate": "Bearer"})
            case Access.FORBIDDEN:
                return error(403, f"this identity may not read {request.path} (RBAC: get on /metrics)")
            case Access.UNREVIEWED:
                return error(503, "the bearer token cannot be reviewed now", {"Retry-After": "1"})
            case _:
                assert_never(access)

    def _may_change(self, request: web.Request, presented: str) -> bool:
        if _same(presented, self.admin_token):
            return True
        return loopback_may_change(request, token_set=self.admin_token is not None, trust=self.trust_loopback)


def loopback_may_change(request: web.Request, *, token_set: bool, trust: bool) -> bool:
    """Whether the caller may change state without the admin token: no token is set (or `trust`,
    admin.trust_loopback), it calls from loopback, and its Host is one DNS cannot rebind (none, an IP
    literal or localhost). The one rule for writes (api.py) and reads: a page of a name rebound to
    127.0.0.1 reaches the port from loopback but names itself in Host, and is neither."""
    trusted = not token_set or trust
    return trusted and is_loopback(request.remote) and _literal_or_none(request.headers.get("Host", ""))


def _same(presented: str, token: str | None) -> bool:
    return token is not None and bool(presented) and hmac.compare_digest(presented.encode(), token.encode())


def error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """The admin API's error answer: one body for every refusal, read or write."""
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)


def is_loopback(peer: str | None) -> bool:
    """A peer address on loopback (an IPv4-mapped one too)."""
    try:
        ip = ipaddress.ip_address(peer or "")
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def _literal_or_none(host: str) -> bool:
    """No Host: a client that is not a browser; else an IP literal or localhost (browser.py)."""
    return not host.strip() or literal_host(host)
