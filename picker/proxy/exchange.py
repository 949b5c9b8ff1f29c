"""One proxied request on its way through (`Exchange`), and the upstream cut its relay raises."""

from __future__ import annotations

import asyncio

from picker.contract import Reply
from picker.proxy.upstream import Opened
from picker.request.pipeline import Routed
from picker.streams.resume import Splice, Why


class UpstreamCut(Exception):
    """The model server's response broke off (reset, or closed in the middle of the body)."""


class Exchange:
    """One routed request on its way through: its upstream response and the client's."""

    __slots__ = (
        "_cut",
        "_task",
        "body",
        "current",
        "moving",
        "outgoing",
        "resume_refused",
        "routed",
        "splice",
    )

    def __init__(
        self, routed: Routed, body: bytes, task: asyncio.Task[object] | None, splice: Splice | None = None
    ) -> None:
        self.routed = routed
        self.body = body  # kept for retries until the first response byte, then dropped
        self._task = task
        self._cut: Reply | None = None
        self.splice = splice  # streams.resume: the stream may continue on another replica if cut
        self.outgoing: list[tuple[str, str]] = []  # the headers sent upstream (a resume sends them again)
        self.current: Opened | None = None  # a resumable stream's part now running
        self.moving: Why | None = None  # ... which the picker is ending, to continue it elsewhere: why
        self.resume_refused: str | None = None  # it asked for resume and cannot have it: why

    def move(self, why: Why = Why.MOVED) -> bool:
        """Continue this stream on another replica now (its own is draining, or it stalled): end
        the part running (vLLM aborts it) and let the resume take it on. False when it cannot."""
        current = self.current
        if current is None or self.moving is not None or self.splice is None or self.splice.done:
            return False
        self.moving = why
        current.response.close()
        return True

    def cut(self, reply: Reply) -> None:
        """The drain deadline: end this exchange with `reply` (a stream gets it as an error event)."""
        if self._cut is None and self._task is not None:
            self._cut = reply
            self._task.cancel()

    def take_cut(self) -> Reply | None:
        """The cut reply, if this cancellation is only the cut (not the client going away too)."""
        task = self._task
        if self._cut is None or task is None:
            return None
        return self._cut if task.uncancel() == 0 else None
