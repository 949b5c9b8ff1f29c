"""Stalls that never make a stream worse (issue 52): the core's stall verdict for resumable streams.

A stream judged stalled moves only where a replica can take it, else it keeps waiting on its own
(counted `stall-kept`) and moves once one can; its silence counts from the start of its current
part; a part that has had no token while its replica queues requests is waiting, not stalled.
"""

from __future__ import annotations

import json

from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.pool.load import LoadSample
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.streams import RequestRecord


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunk() -> bytes:
    frame = {"id": "a", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": " t", "logprobs": None, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(frame).encode() + b"\n\n"


def setup(ready: list[str]) -> tuple[Clock, Pool, Metrics, RequestPath, list[RequestRecord]]:
    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=ready)
    metrics = Metrics(pool="default")
    path = RequestPath(pool, metrics, fallback_count=0, clock=clock, stall_after_s=5.0,
                       schedule=lambda delay, fn: lambda: None)  # fmt: skip
    moved: list[RequestRecord] = []

    def on_stall(record: RequestRecord) -> bool:
        moved.append(record)
        return True

    path.on_stall = on_stall
    return clock, pool, metrics, path, moved


def streaming(path: RequestPath, chunks: int = 1) -> RequestRecord:
    record = path.admit(
        InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)
    ).payload
    record.resumable = True
    path.response_started(record, 200, record.picked[0], streaming=True)
    for _ in range(chunks):
        path.body_chunk(record, chunk())
    return record


def resumes(metrics: Metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value("picker_stream_resumes_total", {"reason": reason})
    return value or 0.0


def test_a_stall_with_nowhere_to_go_keeps_the_stream_and_moves_it_once_a_replica_can_take_it() -> None:
    clock, pool, metrics, path, moved = setup(["a:1"])
    record = streaming(path)
    clock.now = 6.0
    assert path.sweep_stalls() == 1
    assert moved == [] and not record.ended and resumes(metrics, "stall-kept") == 1
    clock.now = 7.0
    path.sweep_stalls()
    assert moved == [] and resumes(metrics, "stall-kept") == 1  # counted once
    pool.apply(ready=["a:1", "b:1"])  # a replica with room
    path.sweep_stalls()
    assert moved == [record]


def test_a_kept_stream_that_sends_again_is_judged_afresh() -> None:
    clock, pool, _, path, moved = setup(["a:1"])
    record = streaming(path)
    clock.now = 6.0
    path.sweep_stalls()
    path.body_chunk(record, chunk())
    pool.apply(ready=["a:1", "b:1"])
    path.sweep_stalls()
    assert moved == [] and not record.stalled


def test_a_stall_where_a_replica_has_room_moves_at_once() -> None:
    clock, _, _, path, moved = setup(["a:1", "b:1"])
    record = streaming(path)
    clock.now = 6.0
    assert path.sweep_stalls() == 1 and moved == [record]


def test_the_silence_clock_restarts_with_each_part() -> None:
    clock, _, _, path, moved = setup(["a:1", "b:1", "c:1"])
    record = streaming(path)
    clock.now = 4.0
    assert path.resume(record, record.served or record.picked[0]) is not None  # cut, continued elsewhere
    clock.now = 6.0  # 6 s after its last chunk, 2 s into its new part
    assert path.sweep_stalls() == 0 and moved == []
    clock.now = 9.5
    assert path.sweep_stalls() == 1


def test_a_part_without_a_token_on_a_replica_that_queues_is_waiting_not_stalled() -> None:
    clock, pool, _, path, moved = setup(["a:1", "b:1"])
    record = streaming(path, chunks=0)  # headers sent, no token yet
    endpoint = pool.get(record.picked[0])
    assert endpoint is not None
    endpoint.load = LoadSample(4.0, 3.0, 0.5, 5.5, 0, 0)  # the engine queues requests
    clock.now = 6.0
    assert path.sweep_stalls() == 0 and moved == []
    endpoint.load = LoadSample(4.0, 0.0, 0.5, 5.9, 0, 0)  # nothing waits there: it is stalled
    assert path.sweep_stalls() == 1


def test_a_stale_queue_gauge_does_not_hide_a_stall() -> None:
    clock, pool, _, path, _ = setup(["a:1", "b:1"])
    record = streaming(path, chunks=0)
    endpoint = pool.get(record.picked[0])
    assert endpoint is not None
    endpoint.load = LoadSample(4.0, 3.0, 0.5, 0.0, 0, 0)  # its last scrape, long before: a dead engine's
    clock.now = 6.0
    assert path.sweep_stalls() == 1


def test_a_stream_that_lacks_only_its_end_is_handed_to_its_frontend_with_nowhere_to_go() -> None:
    """Its finish_reason went out, then silence: the frontend writes the end itself (resume's
    `finish_locally`), whether or not another replica has room."""
    clock, _, metrics, path, moved = setup(["a:1"])
    record = streaming(path)
    choice = {"index": 0, "text": " t", "logprobs": None, "finish_reason": "length"}
    frame = {"id": "a", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    path.body_chunk(record, b"data: " + json.dumps(frame).encode() + b"\n\n")
    clock.now = 6.0
    assert path.sweep_stalls() == 1 and moved == [record] and resumes(metrics, "stall-kept") == 0


def test_a_kept_stream_whose_replica_goes_is_handed_over_not_left_hanging() -> None:
    """Kept on its own replica (nowhere to move), then that replica is gone: it will never send
    again, so its frontend cuts it (or it ends here), instead of waiting for ever."""
    clock, pool, _, path, moved = setup(["a:1"])
    record = streaming(path)
    clock.now = 6.0
    path.sweep_stalls()
    assert record.stall_kept and moved == []
    pool.apply(ready=[])  # a:1 removed while its stream is open
    path.sweep_stalls()
    assert moved == [record]
    clock2, pool2, _, path2, _ = setup(["a:1"])  # a frontend that cannot take it: the core ends it
    path2.on_stall = lambda r: False
    kept = streaming(path2)
    clock2.now = 6.0
    path2.sweep_stalls()
    pool2.apply(ready=[])
    path2.sweep_stalls()
    assert kept.ended and kept.end_reason is not None and kept.end_reason.value == "stalled"


def test_a_queue_gauge_excuses_a_silent_part_only_for_a_while() -> None:
    """A hung engine's API server goes on showing its last queue: after four stall bounds the
    part is judged stalled all the same."""
    clock, pool, _, path, _ = setup(["a:1", "b:1"])
    record = streaming(path, chunks=0)
    endpoint = pool.get(record.picked[0])
    assert endpoint is not None
    for now in (6.0, 12.0, 19.0):
        clock.now = now
        endpoint.load = LoadSample(4.0, 3.0, 0.5, now - 0.1, 0, 0)  # fresh, and waiting
        assert path.sweep_stalls() == 0
    clock.now = 20.5
    endpoint.load = LoadSample(4.0, 3.0, 0.5, 20.4, 0, 0)
    assert path.sweep_stalls() == 1
