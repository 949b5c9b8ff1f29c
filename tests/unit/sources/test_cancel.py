"""A cancel an HTTP client swallowed is honoured at the source loop's next turn (sources/cancel.py)."""

from __future__ import annotations

import asyncio

from picker.sources.cancel import raise_if_cancelled


async def _request_that_swallows_a_cancel(entered: asyncio.Event) -> None:
    entered.set()
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # what a client's timeout scope did on the way out (the leader-election hang)


async def test_a_loop_ends_when_its_cancel_went_missing_in_a_request() -> None:
    entered = asyncio.Event()

    async def loop() -> None:
        while True:
            raise_if_cancelled()
            await _request_that_swallows_a_cancel(entered)

    task = asyncio.create_task(loop())
    await entered.wait()
    task.cancel()
    async with asyncio.timeout(5):  # without the check the loop runs on and this times out
        await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_nothing_is_raised_without_a_cancel() -> None:
    raise_if_cancelled()
