"""The per-replica request log: what happened to each request, for tests to query (GET /sim/requests).

Bounded (a ring buffer); holds ids, timings and counts, never prompt or completion text.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import deque
from typing import Any


class Outcome(enum.Enum):
    """How a request ended, from the simulator's point of view."""

    IN_FLIGHT = "in-flight"
    COMPLETED = "completed"  # finish_reason stop or length
    ABORTED = "aborted"  # the client went away (queued, generating or non-streaming)
    REJECTED = "rejected"  # 503: waiting queue full
    BAD_REQUEST = "bad-request"  # 400
    NOT_FOUND = "not-found"  # 404: unknown model
    FAULT_STATUS = "fault-status"  # injected status before any token
    ERROR = "error"  # injected in-stream error event (or 500 for non-streaming)
    RESET = "reset"  # injected TCP reset
    STALLED = "stalled"  # injected stall; ends when the client goes away
    SHUTDOWN_500 = "shutdown-500"  # new work during a drain: "cannot schedule new futures after shutdown"
    SHUTDOWN_ABORT = "shutdown-abort"  # cut by a shutdown with finish_reason "abort"
    SHUTDOWN_ERROR = "shutdown-error"  # cut by a shutdown with the EngineCore error event
    HUNG = "hung"  # left hanging by a shutdown; ends when the client goes away (or the hang limit)
    KILLED = "killed"  # connection closed by Replica.stop() / a second SIGTERM
    PREFILL_FAILED = "prefill-failed"  # the sidecar's prefill step failed: its status passed on
    KV_LOAD_FAILED = "kv-load-failed"  # a decode whose KV pull failed, policy "fail": 500 / error event
    INTERNAL_ERROR = "internal-error"  # a simulator bug (logged with its traceback)


class RequestRecord:
    """One request's entry; mutated in place while the request runs."""

    __slots__ = (
        "arrival",
        "end",
        "finish_reason",
        "first_token_at",
        "model",
        "outcome",
        "path",
        "prefiller",
        "prompt_tokens",
        "remote_decode",
        "request_id",
        "status",
        "stream",
        "tokens_sent",
        "traceparent",
    )

    def __init__(self, request_id: str, path: str, arrival: float) -> None:
        self.request_id = request_id
        self.path = path
        self.arrival = arrival
        self.model: str | None = None
        self.stream = False
        self.status: int | None = None
        self.first_token_at: float | None = None
        self.end: float | None = None
        self.outcome = Outcome.IN_FLIGHT
        self.tokens_sent = 0
        self.prompt_tokens = 0
        self.finish_reason: str | None = None
        self.traceparent: str | None = None  # the W3C trace context it came with (vLLM continues it)
        self.prefiller: str | None = None  # the x-prefiller-host-port it came with (a picker's P/D pick)
        self.remote_decode = False  # a prefill step: its kv_transfer_params asked for a remote decode

    def finish(self, outcome: Outcome, finish_reason: str | None = None) -> bool:
        """Close the record once; later calls keep the first outcome (the one that really ended it)."""
        if self.outcome is not Outcome.IN_FLIGHT:
            return False
        self.outcome = outcome
        self.finish_reason = finish_reason
        self.end = time.time()
        return True

    def to_json(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "path": self.path,
            "model": self.model,
            "stream": self.stream,
            "status": self.status,
            "arrival": self.arrival,
            "first_token_at": self.first_token_at,
            "end": self.end,
            "outcome": self.outcome.value,
            "tokens_sent": self.tokens_sent,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "traceparent": self.traceparent,
            "prefiller": self.prefiller,
            "remote_decode": self.remote_decode,
        }


class RequestLog:
    """Ring buffer of the last `size` completion requests of one replica."""

    def __init__(self, size: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=size)
        self._ids = itertools.count(1)
        self._prefix = f"sim-{int(time.time() * 1000) % 10**8:08d}"

    def open(self, request_id: str | None, path: str) -> RequestRecord:
        record = RequestRecord(request_id or f"{self._prefix}-{next(self._ids)}", path, time.time())
        self._records.append(record)
        return record

    def snapshot(self, request_id: str | None = None) -> list[dict[str, Any]]:
        return [r.to_json() for r in self._records if request_id is None or r.request_id == request_id]

    def clear(self) -> None:
        self._records.clear()
