"""One end reason per request, from what the observer saw and what Envoy's access log said."""

from __future__ import annotations

from typing import assert_never

from picker.pool import DrainEnd
from picker.streams.record import Attempts, EndReason, RequestRecord

# Envoy response flags (access-log names) that say who ended a stream early.
DOWNSTREAM_FLAGS = frozenset({"downstream_connection_termination", "downstream_remote_reset"})
UPSTREAM_FLAGS = frozenset(
    {
        "upstream_remote_reset",
        "upstream_connection_termination",
        "upstream_protocol_error",
        "upstream_connection_failure",
        "upstream_request_timeout",
        "local_reset",
    }
)
IDLE_FLAGS = frozenset({"stream_idle_timeout"})
# vLLM's answer to new work once SIGTERM has started its drain (HTTP 500, measured on vLLM 0.32; see
# /work/shared/reference/vllm.md): the engine takes no new request, whatever the picker was told.
_SHUTDOWN_REFUSAL = b"cannot schedule new futures after shutdown"


def shutting_down(first_chunk: bytes) -> bool:
    """Whether a 500's first body chunk is vLLM refusing work because its engine is shutting down."""
    return _SHUTDOWN_REFUSAL in first_chunk


def from_body(record: RequestRecord) -> EndReason | None:
    """The reason when the response body alone settles it, else None (the access log must say)."""
    tracker = record.tracker
    if (
        record.status is not None
        and record.status >= 500
        and (tracker is None or tracker.first_byte_at is None or not tracker.streaming)
    ):
        return EndReason.UPSTREAM_ERROR_STATUS
    if tracker is None:
        return EndReason.COMPLETED if record.response_ended else None
    if tracker.error_event:
        return EndReason.UPSTREAM_ERROR_EVENT
    if tracker.finish_reason == "abort":
        return EndReason.UPSTREAM_TRUNCATED  # vLLM's silent truncation: HTTP 200 + [DONE], too few tokens
    if record.response_ended:
        if tracker.streaming and tracker.first_byte_at is not None and not tracker.completed:
            return EndReason.UPSTREAM_TRUNCATED  # a clean close in the middle of the stream
        return EndReason.COMPLETED
    return None


def from_access_log(record: RequestRecord, log: Attempts) -> EndReason:
    """Settle an ending the body could not: Envoy knows which side closed the stream."""
    settled = from_body(record)
    if settled is not None:
        return settled
    if log.flags & IDLE_FLAGS or record.stalled:
        return EndReason.STALLED  # even when the client finally gave up on it: the stall came first
    if log.flags & DOWNSTREAM_FLAGS:
        return EndReason.CLIENT_DISCONNECT
    if log.flags & UPSTREAM_FLAGS:
        if record.response_started_at is None and log.status >= 500:
            return EndReason.UPSTREAM_ERROR_STATUS
        return EndReason.UPSTREAM_TRUNCATED
    if log.status >= 500:
        return EndReason.UPSTREAM_ERROR_STATUS
    return EndReason.COMPLETED


def drain_end(reason: EndReason) -> DrainEnd:
    """The pool's words for how a request ended (drain records count these)."""
    match reason:
        case EndReason.COMPLETED:
            return DrainEnd.COMPLETED
        case EndReason.CLIENT_DISCONNECT:
            return DrainEnd.CLIENT_DISCONNECT
        case EndReason.UPSTREAM_ERROR_EVENT | EndReason.UPSTREAM_ERROR_STATUS:
            return DrainEnd.UPSTREAM_ERROR
        case EndReason.UPSTREAM_TRUNCATED | EndReason.STALLED | EndReason.SHUTDOWN_CUT:
            return DrainEnd.CUT
        case EndReason.REJECTED | EndReason.UNOBSERVED:
            return DrainEnd.UNKNOWN
        case _:
            assert_never(reason)
