"""Response tracking and end-reason classification (no servers)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.pool import DrainEnd
from picker.request.tracking import drain_end
from picker.streams import Attempts, EndReason, RequestRecord, ResponseTracker, from_access_log, from_body


def chunk(text: str = "tok", finish: str | None = None) -> bytes:
    event = {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
        ],
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


USAGE = (
    b'data: {"id":"cmpl-1","choices":[],'
    b'"usage":{"prompt_tokens":3,"total_tokens":8,"completion_tokens":5}}\n\n'
)
DONE = b"data: [DONE]\n\n"
ERROR = (
    b'data: {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError", '
    b'"param": null, "code": 500}}\n\n'
)


def stream(tokens: int, finish: str = "length", usage: bool = True) -> bytes:
    body = b"".join(chunk() for _ in range(tokens - 1)) + chunk(finish=finish)
    return body + (USAGE if usage else b"") + DONE


def test_tracker_counts_tokens_and_reads_usage_and_finish() -> None:
    tracker = ResponseTracker(streaming=True)
    gaps = [tracker.feed(part, float(i)) for i, part in enumerate([stream(5)[:7], stream(5)[7:]])]
    assert gaps == [None, 1.0]
    assert tracker.token_chunks == 5 and tracker.tokens == 5 and tracker.done
    assert tracker.finish_reason == "length" and tracker.completed


def test_tracker_sees_error_events_and_aborts() -> None:
    errored = ResponseTracker(streaming=True)
    errored.feed(chunk() + ERROR + DONE, 0.0)
    assert errored.error_event and not errored.completed
    aborted = ResponseTracker(streaming=True)
    aborted.feed(stream(3, finish="abort"), 0.0)
    assert aborted.done and not aborted.completed


def test_non_streaming_body_is_decoded_once_at_the_end() -> None:
    tracker = ResponseTracker(streaming=False)
    body = json.dumps(
        {"choices": [{"text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 7}}
    ).encode()
    tracker.feed(body[:10], 0.0)
    tracker.feed(body[10:], 0.1)
    tracker.end()
    assert tracker.finish_reason == "length" and tracker.tokens == 7 and tracker.completed


def test_an_engine_writing_nan_is_still_read() -> None:
    """Python's json.dumps writes NaN, which strict JSON readers refuse: the usage is read anyway."""
    tracker = ResponseTracker(streaming=False)
    tracker.feed(
        b'{"choices": [{"finish_reason": "stop", "logprob": NaN}], "usage": {"completion_tokens": 3}}', 0.0
    )
    tracker.end()
    assert tracker.finish_reason == "stop" and tracker.tokens == 3
    streamed = ResponseTracker(streaming=True)
    streamed.feed(b'data: {"choices": [{"finish_reason": "length", "x": -Infinity}]}\n\n', 0.0)
    assert streamed.finish_reason == "length"


@settings(max_examples=100, deadline=None)
@given(tokens=st.integers(1, 30), cuts=st.lists(st.integers(0, 5000), max_size=10))
def test_any_chunking_counts_the_same(tokens: int, cuts: list[int]) -> None:
    raw = stream(tokens)
    points = sorted({c % (len(raw) + 1) for c in cuts})
    tracker = ResponseTracker(streaming=True)
    for a, b in zip([0, *points], [*points, len(raw)], strict=True):
        tracker.feed(raw[a:b], 0.0)
    assert (tracker.token_chunks, tracker.tokens, tracker.done, tracker.finish_reason) == (
        tokens,
        5,
        True,
        "length",
    )


def record(body: bytes | None, *, ended: bool, status: int = 200, streaming: bool = True) -> RequestRecord:
    rec = RequestRecord(
        request_id="r", admitted_at=0.0, stream=streaming, status=status, response_started_at=0.1
    )
    rec.tracker = ResponseTracker(streaming=streaming)
    if body is not None:
        rec.tracker.feed(body, 0.2)
    rec.response_ended = ended
    return rec


@pytest.mark.parametrize(
    ("body", "ended", "status", "expected"),
    [
        (stream(4), True, 200, EndReason.COMPLETED),
        (stream(4, finish="abort"), True, 200, EndReason.UPSTREAM_TRUNCATED),  # vLLM's silent truncation
        (chunk() + ERROR + DONE, True, 200, EndReason.UPSTREAM_ERROR_EVENT),
        (chunk() + chunk(), True, 200, EndReason.UPSTREAM_TRUNCATED),  # clean close mid-stream
        (
            b'{"error": {"message": "cannot schedule new futures after shutdown"}}',
            True,
            500,
            EndReason.UPSTREAM_ERROR_STATUS,
        ),
        (chunk() + chunk(), False, 200, None),  # cut short: ask the access log
    ],
)
def test_body_settles_what_it_can(body: bytes, ended: bool, status: int, expected: EndReason | None) -> None:
    assert from_body(record(body, ended=ended, status=status, streaming=status == 200)) == expected


@pytest.mark.parametrize(
    ("flags", "status", "started", "expected"),
    [
        ({"downstream_remote_reset"}, 200, True, EndReason.CLIENT_DISCONNECT),
        ({"downstream_connection_termination"}, 200, True, EndReason.CLIENT_DISCONNECT),
        ({"upstream_protocol_error"}, 200, True, EndReason.UPSTREAM_TRUNCATED),
        ({"upstream_remote_reset"}, 200, True, EndReason.UPSTREAM_TRUNCATED),
        ({"stream_idle_timeout"}, 200, True, EndReason.STALLED),
        ({"upstream_connection_failure"}, 503, False, EndReason.UPSTREAM_ERROR_STATUS),
        (set(), 200, True, EndReason.COMPLETED),
    ],
)
def test_access_log_settles_the_rest(
    flags: set[str], status: int, started: bool, expected: EndReason
) -> None:
    rec = record(chunk() if started else None, ended=False, status=status)
    if not started:
        rec.response_started_at = None
        rec.tracker = None
    assert from_access_log(rec, Attempts(flags=frozenset(flags), status=status)) == expected


@pytest.mark.parametrize("reason", list(EndReason))
def test_every_end_reason_maps_to_a_drain_category(reason: EndReason) -> None:
    assert isinstance(drain_end(reason), DrainEnd)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_stalls_are_counted_and_a_gone_engines_stream_is_let_go() -> None:
    from picker.observability.metrics import Metrics
    from picker.pool import EndpointState, Pool
    from picker.request.inference import InferenceRequest
    from picker.request.pipeline import RequestPath

    clock = Clock()
    pool = Pool(clock)
    pool.apply(ready=["a:1", "b:1"])
    metrics = Metrics(pool="default")
    path = RequestPath(
        pool,
        metrics,
        fallback_count=0,
        clock=clock,
        stall_after_s=5.0,
        schedule=lambda delay, fn: lambda: None,
    )
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)
    records = []
    for _ in range(2):
        ticket = path.admit(request)
        record = ticket.payload
        path.response_started(record, 200, record.picked[0], streaming=True)
        path.body_chunk(record, chunk())
        records.append(record)
    assert {r.endpoint for r in records} == {"a:1", "b:1"}
    clock.now = 4.0
    assert path.sweep_stalls() == 0
    gone = next(r for r in records if r.endpoint == "b:1")
    pool.apply(ready=["a:1"])  # b:1 removed: GONE while its stream is still open
    assert pool.get("b:1").state is EndpointState.GONE  # type: ignore[union-attr]
    clock.now = 6.0
    assert path.sweep_stalls() == 2  # both silent for 6 s; each counted once
    assert path.sweep_stalls() == 0
    assert gone.end_reason is EndReason.STALLED and pool.get("b:1") is None  # let go, endpoint forgotten
    kept = next(r for r in records if r.endpoint == "a:1")
    assert not kept.ended and kept.stalled  # its engine may still answer: still counted in flight
    assert metrics.registry.get_sample_value("picker_endpoint_stalls_total", {"endpoint": "a:1"}) == 1
