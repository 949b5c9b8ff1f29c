"""A cancel the HTTP clients swallowed, honoured at a loop's next turn.

A task cancelled while an HTTP request of its is in flight (lightkube over httpx, aiohttp) can have
the CancelledError absorbed on the way out of the client's own timeout scopes: the task then runs
on, and whoever awaits its end (a shutdown, a test's stop) hangs. Seen: a leader-election test hung
30 s in one run of two. `cancelling()` still counts the cancel, so each source loop checks it.
"""

from __future__ import annotations

import asyncio


def raise_if_cancelled() -> None:
    """Raise CancelledError if the running task was cancelled and the cancel went missing."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
