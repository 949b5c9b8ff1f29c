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
        "_interrupting",
        "_task",
        "body",
        "current",
        "exhausted",
        "moving",
        "outgoing",
        "reading",
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
        self.moving: Why | None = None  # ... which the picker asked to continue elsewhere: why
        self.reading = False  # the relay waits for the running part's next bytes (and only for them)
        self.exhausted = False  # streams.resume_max tries spent (or it cannot be continued): no more moves
        self.resume_refused: str | None = None  # it asked for resume and cannot have it: why
        self._interrupting = False  # `move` cancelled the relay's read

    def move(self, why: Why = Why.MOVED, gone: bool = False) -> bool:
        """Continue this stream on another replica now (its own is draining, or it stalled). The
        part running is not ended here: the relay opens the continuation first and ends the part
        only once it has opened, so a move no replica takes leaves the stream as it was. A relay
        waiting for the part's bytes is woken (its read cancelled: nothing read is lost). False
        when it cannot move. `gone`: its replica left the pool and will never send again, so even
        a stream with no tries left is woken (the relay ends the part, and cuts the stream)."""
        splice = self.splice
        if self.current is None or self.moving is not None or splice is None or splice.done:
            return False
        if self.exhausted and splice.finished is None and not gone:  # one lacking only its end needs no try
            return False
        self.moving = why
        if self.reading and self._task is not None:
            self._interrupting = True
            self._task.cancel()
        return True

    def interrupted(self) -> bool:
        """The cancellation the relay caught at its read is this exchange's move alone (withdrawn
        here); False: something else cancels the relay too (the client left, or a cut)."""
        if not self._interrupting or self._task is None:
            return False
        self._interrupting = False
        return self._task.uncancel() == 0

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
