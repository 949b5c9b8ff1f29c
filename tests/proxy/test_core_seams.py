"""The core seams the proxy uses (RequestPath.response_ended, .upstream_retried; a move waking the
relay), without sockets."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest

from picker.contract import Outcome, reply_for
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.proxy.exchange import Exchange
from picker.proxy.upstream import Opened
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath, Routed
from picker.streams import EndReason, RequestRecord
from picker.streams.resume import Why, prepare

TOKEN = b'data: {"choices":[{"text":" t","finish_reason":null}]}\n\n'
LAST = b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'
ERROR = b'data: {"error":{"message":"boom","code":500}}\n\ndata: [DONE]\n\n'


def started(stream: bool = True) -> tuple[RequestPath, Pool, Metrics, RequestRecord]:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    metrics = Metrics(pool="default")
    path = RequestPath(pool, metrics, fallback_count=1, schedule=lambda delay, fn: lambda: None)
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=stream)
    record = path.admit(request).payload
    path.response_started(record, 200, record.picked[0], streaming=stream)
    return path, pool, metrics, record


@pytest.mark.parametrize(
    ("chunks", "end_of_stream", "cut", "expected"),
    [
        ([TOKEN, LAST], True, EndReason.COMPLETED, EndReason.COMPLETED),
        ([TOKEN, TOKEN], True, EndReason.COMPLETED, EndReason.UPSTREAM_TRUNCATED),  # clean close, no end
        ([TOKEN], False, EndReason.CLIENT_DISCONNECT, EndReason.CLIENT_DISCONNECT),
        ([TOKEN], False, EndReason.UPSTREAM_TRUNCATED, EndReason.UPSTREAM_TRUNCATED),
        ([TOKEN, ERROR], False, EndReason.CLIENT_DISCONNECT, EndReason.UPSTREAM_ERROR_EVENT),  # body first
    ],
    ids=["completed", "closed-early", "client-gone", "upstream-cut", "error-event-wins"],
)
def test_one_end_reason_from_the_body_else_the_frontends_word(
    chunks: list[bytes], end_of_stream: bool, cut: EndReason, expected: EndReason
) -> None:
    path, pool, _, record = started()
    for chunk in chunks:
        path.body_chunk(record, chunk)
    path.response_ended(record, end_of_stream, cut)
    path.response_ended(record, True, EndReason.COMPLETED)  # a second report changes nothing
    assert record.end_reason is expected
    assert path.live == 0 and pool.in_flight() == 0


def test_a_stalled_stream_that_ends_cut_counts_as_stalled() -> None:
    path, _, _, record = started()
    path.body_chunk(record, TOKEN)
    record.stalled = True
    path.response_ended(record, False, EndReason.CLIENT_DISCONNECT)
    assert record.end_reason is EndReason.STALLED


def test_retries_are_counted_against_who_served() -> None:
    pool = Pool()
    pool.apply(ready=["a:1", "b:1"])
    metrics = Metrics(pool="default")
    path = RequestPath(pool, metrics, fallback_count=1, schedule=lambda delay, fn: lambda: None)
    record = path.admit(InferenceRequest(method="POST", path="/v1/completions", model="m")).payload
    primary, fallback = record.picked
    path.response_started(record, 200, fallback, streaming=False)
    path.upstream_retried(record, 1)
    path.upstream_retried(record, 0)  # no retry: nothing counted
    sample = metrics.registry.get_sample_value
    assert sample("picker_upstream_retries_total", {"endpoint": fallback}) == 1
    assert sample("picker_upstream_retries_total", {"endpoint": primary}) is None


async def waiting_relay(exchange_ready: asyncio.Future[Exchange], read: asyncio.Future[bytes]) -> str:
    """A relay waiting for its part's bytes, as picker/proxy/resuming.py's `_part` does."""
    _, _, _, record = started()
    _, splice = prepare({"model": "m", "prompt": "hi", "stream": True, "temperature": 0}, chat=False)
    exchange = Exchange(Routed(record, ("a:1",)), b"", asyncio.current_task(), splice)
    exchange.current = cast(Opened, object())  # a part is running
    exchange_ready.set_result(exchange)
    exchange.reading = True
    try:
        await read
    except asyncio.CancelledError:
        if not exchange.interrupted():
            raise
        return "move"
    finally:
        exchange.reading = False
    return "read"


async def test_a_move_wakes_the_relays_read_without_ending_the_part_or_hiding_a_cut() -> None:
    """A move cancels only the relay's wait (withdrawn at once: its part is not ended, nothing read
    is lost); a cut asked at the same time still ends the relay, as the cut."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[Exchange] = loop.create_future()
    task = asyncio.create_task(waiting_relay(ready, loop.create_future()))
    exchange = await ready  # the relay waits at its read by now: it went on to it before this woke
    assert exchange.move(Why.STALLED) and not exchange.move(Why.STALLED)  # one move at a time
    assert await task == "move" and task.cancelling() == 0

    ready = loop.create_future()
    task = asyncio.create_task(waiting_relay(ready, loop.create_future()))
    exchange = await ready
    cut = reply_for(Outcome.REJECTED_SHUTTING_DOWN)
    assert exchange.move(Why.MOVED)
    exchange.cut(cut)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert exchange.take_cut() is cut
