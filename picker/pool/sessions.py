"""Session affinity: which endpoint each conversation was last routed to, for a time to live.

The session is named by a request header the operator chooses (`scheduling.session_header`, e.g.
`x-session-id`, the reference picker's `session_id` mode). A session is bound to the endpoint its
last request went to and expires `ttl_s` after that request; a bound endpoint that is no longer
ready (draining, gone) or that is saturated is the scheduler's to refuse, and the session then
binds to wherever the request goes. Bounded: past `max_sessions` the least recently used ones go.

Plain data with an injected clock; no I/O, no timers (expired entries go when looked up or pushed
out by newer ones).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class Sessions:
    def __init__(
        self, ttl_s: float = 300.0, max_sessions: int = 100_000, clock: Callable[[], float] = time.monotonic
    ):
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._clock = clock
        self._bound: OrderedDict[str, tuple[str, float]] = OrderedDict()  # session -> (address, expiry)

    def __len__(self) -> int:
        return len(self._bound)

    def endpoint(self, session: str) -> str | None:
        """The endpoint the session is bound to, while the binding lives."""
        entry = self._bound.get(session)
        if entry is None:
            return None
        if entry[1] <= self._clock():
            del self._bound[session]
            return None
        return entry[0]

    def bind(self, session: str, address: str) -> None:
        """The session's request went to `address`: bound there for another TTL."""
        self._bound[session] = (address, self._clock() + self.ttl_s)
        self._bound.move_to_end(session)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)

    def forget_endpoint(self, address: str) -> int:
        """The endpoint is gone for good: its sessions bind anew on their next request."""
        stale = [session for session, (bound, _) in self._bound.items() if bound == address]
        for session in stale:
            del self._bound[session]
        return len(stale)
