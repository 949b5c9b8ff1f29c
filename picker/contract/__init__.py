"""The status contract: what every non-dispatched outcome looks like on the wire.

The only module that holds status codes, reason strings, retryability and Retry-After values, so
client and gateway retry policies can be written against one table (docs, "Status contract").
Reason strings are the llm-d router's, so policies written for it carry over. The names of every
header the picker reads or writes are the contract's too (`headers.py`). A leaf: imports nothing of
the picker.
"""

from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, replace
from typing import assert_never

from picker.contract import headers


class Outcome(enum.Enum):
    """How the picker disposed of one request (closed set; every member has one reply)."""

    DISPATCHED = "dispatched"
    REJECTED_SATURATED = "rejected-saturated"
    REJECTED_TTL_EXPIRED = "rejected-ttl-expired"
    REJECTED_NO_ENDPOINTS = "rejected-no-endpoints"
    REJECTED_SHUTTING_DOWN = "rejected-shutting-down"
    REJECTED_CONTEXT_CANCELLED = "rejected-context-cancelled"
    # scheduling.by_model: no endpoint serves the request's model (or adapter), or none has a
    # context window its prompt + max_tokens fits (rather than a replica's 404 or 400)
    REJECTED_MODEL_NOT_SERVED = "rejected-model-not-served"
    REJECTED_CONTEXT_TOO_LONG = "rejected-context-too-long"
    # affinity.latency: a sheddable request (priority < 0) whose SLO headers no replica is predicted
    # to meet now; a critical one goes to the best replica instead
    REJECTED_SLO_UNATTAINABLE = "rejected-slo-unattainable"
    # tenants.budgets: the tenant (fairness id) has spent its token budget for now (every picker
    # sharing the books counts); Retry-After says when its budget has room again
    REJECTED_OVER_BUDGET = "rejected-over-budget"
    BAD_REQUEST = "bad-request"
    TOO_LARGE = "too-large"
    INTERNAL_ERROR = "internal-error"
    # Envoy could not reach the picker (failClose): answered by Envoy's local_reply_config, which
    # config/envoy.yaml renders from this reply; the picker itself never sends it.
    PICKER_UNAVAILABLE = "picker-unavailable"


@dataclass(frozen=True, slots=True)
class Reply:
    """A complete local answer: status, headers and an OpenAI-style JSON error body."""

    outcome: Outcome
    status: int
    retryable: bool
    retry_after_s: int | None
    error_type: str
    message: str

    @property
    def reason(self) -> str:
        return self.outcome.value

    def headers(self) -> list[tuple[str, str]]:
        out = [(headers.CONTENT_TYPE, "application/json"), (headers.DROPPED_REASON, self.reason)]
        if self.retry_after_s is not None:
            out.append((headers.RETRY_AFTER, str(self.retry_after_s)))
        return out

    def body(self) -> bytes:
        error = {"message": self.message, "type": self.error_type, "code": self.status, "reason": self.reason}
        return json.dumps({"error": error}).encode()


# Seconds a client should wait before retrying a retryable rejection.
_RETRY_AFTER_SATURATED_S = 1
_RETRY_AFTER_UNAVAILABLE_S = 2
# The ext_proc filter's status_on_error in the shipped Envoy config: a code neither the picker nor
# Envoy ever answers with, so one local_reply_config mapper can tell "picker unreachable" from every
# other 503 and restate it as the PICKER_UNAVAILABLE reply (it never reaches a client).
ENVOY_PICKER_ERROR_STATUS = 506


def reply_for(outcome: Outcome, message: str = "", retry_after_s: float | None = None) -> Reply:
    """The one translation from an outcome to its public reply. `retry_after_s`: when the refusal
    knows when room comes back (a tenant's budget), the seconds a client should wait (rounded up)."""
    reply = _reply(outcome, message)
    if retry_after_s is not None and reply.retry_after_s is not None:
        return replace(reply, retry_after_s=max(1, math.ceil(retry_after_s)))
    return reply


# the 429s that say "not now": their default messages
_TOO_MANY = {
    Outcome.REJECTED_SATURATED: "all model servers are saturated and the admission queue is full",
    Outcome.REJECTED_SLO_UNATTAINABLE: "no model server is predicted to meet this sheddable request's "
    "latency objective now",
    Outcome.REJECTED_OVER_BUDGET: "this tenant's token budget is spent for now; retry after the time given",
}


def _reply(outcome: Outcome, message: str) -> Reply:
    match outcome:
        case Outcome.REJECTED_SATURATED | Outcome.REJECTED_SLO_UNATTAINABLE | Outcome.REJECTED_OVER_BUDGET:
            return Reply(
                outcome,
                429,
                True,
                _RETRY_AFTER_SATURATED_S,
                "rate_limit_error",
                message or _TOO_MANY[outcome],
            )
        case Outcome.REJECTED_TTL_EXPIRED:
            return Reply(
                outcome,
                429,
                True,
                _RETRY_AFTER_SATURATED_S,
                "rate_limit_error",
                message or "the request waited for capacity longer than its time-to-live",
            )
        case Outcome.REJECTED_NO_ENDPOINTS:
            return Reply(
                outcome,
                503,
                True,
                _RETRY_AFTER_UNAVAILABLE_S,
                "service_unavailable",
                message or "no ready model server endpoint",
            )
        case Outcome.REJECTED_SHUTTING_DOWN:
            return Reply(
                outcome,
                503,
                True,
                _RETRY_AFTER_UNAVAILABLE_S,
                "service_unavailable",
                message or "the endpoint picker is shutting down; retry",
            )
        case Outcome.REJECTED_CONTEXT_CANCELLED:
            # Nobody is left to read it; it exists so the outcome is counted like every other.
            return Reply(
                outcome,
                499,
                False,
                None,
                "client_closed_request",
                message or "the client went away while the request was queued",
            )
        case Outcome.REJECTED_MODEL_NOT_SERVED:
            return Reply(
                outcome, 404, False, None, "not_found_error", message or "no model server serves this model"
            )
        case Outcome.REJECTED_CONTEXT_TOO_LONG:
            return Reply(
                outcome,
                400,
                False,
                None,
                "invalid_request_error",
                message or "the prompt plus max_tokens fits no model server's context window",
            )
        case Outcome.BAD_REQUEST:
            return Reply(outcome, 400, False, None, "invalid_request_error", message or "bad request")
        case Outcome.TOO_LARGE:
            return Reply(
                outcome, 413, False, None, "invalid_request_error", message or "request body too large"
            )
        case Outcome.INTERNAL_ERROR:
            return Reply(outcome, 500, False, None, "internal_error", message or "internal error")
        case Outcome.PICKER_UNAVAILABLE:
            return Reply(
                outcome,
                503,
                True,
                _RETRY_AFTER_UNAVAILABLE_S,
                "service_unavailable",
                message or "the endpoint picker is unreachable; retry",
            )
        case Outcome.DISPATCHED:
            raise ValueError("a dispatched request is answered by its model server, not the picker")
        case _:
            assert_never(outcome)
