"""One call to a running picker's admin API, for the commands that read or steer it (`picker rollout`,
`picker tenants`). Standard library only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def admin_call(
    url: str, path: str, token: str | None, post: bool = False, timeout_s: float = 10.0
) -> tuple[int, dict[str, Any]]:
    """The admin API's answer to GET (or an empty POST) of `path` (status code, JSON body); a body
    that is not JSON comes back as the error's message."""
    request = urllib.request.Request(
        f"{url.rstrip('/')}{path}",
        data=b"" if post else None,
        method="POST" if post else "GET",
        headers={"Authorization": f"Bearer {token}"} if token else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as exc:
        body = exc.read()
        try:
            return exc.code, json.loads(body or b"{}")
        except ValueError:
            return exc.code, {"error": {"message": body.decode("utf-8", "replace")[:200]}}
