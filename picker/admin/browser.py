"""Browser-safe admin: a web page the operator has open cannot change a picker's state.

Operators reach the admin port through `kubectl port-forward`, whose connections arrive from
loopback: with no admin token set, a loopback caller may drain. Any page in the same browser could
then `fetch("http://localhost:9090/admin/...", {method: "POST", mode: "no-cors"})`, a simple request
that needs no CORS preflight. So a state-changing request that carries a browser's marks must show
it comes from the picker's own status page, whatever the token setting:

- `Sec-Fetch-Site` other than `same-origin` (or `none`, typed by the user) is refused;
- an `Origin` that is not the request's own `Host` (or `null`) is refused;
- it must carry `X-Picker-Admin`, a header a simple request cannot carry: a cross-origin page can
  only send it after a CORS preflight, which the admin port never grants;
- with no token set, its `Host` must be an IP literal or `localhost`: a DNS-rebound name (a page of
  evil.example whose name now resolves to 127.0.0.1 is same-origin for the browser) is refused;
  with a token set, such a Host never stands in for the token either, trust_loopback or not
  (read_auth.loopback_may_change, the one rule for reads and writes).

Requests without any browser mark (curl, `picker drain-wait`, `picker rollout`) are judged by the
token rules alone, as before. Pure: headers in, a reason out.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from urllib.parse import urlsplit

ADMIN_HEADER = "X-Picker-Admin"  # the status page sends it; a simple cross-site request cannot
_MARKS = ("Origin", "Sec-Fetch-Site", "Sec-Fetch-Mode", "Sec-Fetch-Dest")
_SAME = ("same-origin", "none")


def refusal(headers: Mapping[str, str], token_set: bool) -> str | None:
    """Why this state-changing request is refused as a browser's cross-site request (None: it is
    not one). `headers`: case-insensitive (aiohttp's CIMultiDict)."""
    if not any(mark in headers for mark in _MARKS):
        return None  # not a browser: the token rules decide
    site = headers.get("Sec-Fetch-Site")
    if site is not None and site.strip().lower() not in _SAME:
        return "cross-site"
    host = headers.get("Host", "")
    origin = headers.get("Origin")
    if origin is not None and not _same_origin(origin, host):
        return "cross-origin"
    if ADMIN_HEADER not in headers:
        return "no-admin-header"
    if not token_set and not literal_host(host):
        return "host-not-literal"
    return None


def _same_origin(origin: str, host: str) -> bool:
    if origin.strip().lower() == "null" or not host:
        return False
    parts = urlsplit(origin.strip())
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.strip().lower()


def literal_host(host: str) -> bool:
    """`host[:port]` names an IP address or localhost (nothing DNS can rebind)."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.rsplit(":", 1)[0]
    if name in ("localhost", "localhost."):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
