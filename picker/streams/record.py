"""The record of one request, from admission to its single end reason."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from picker.pool import Lease


class EndReason(enum.Enum):
    """How a request ended, as far as the picker can tell (closed set)."""

    COMPLETED = "completed"  # the response reached its end of stream
    ABORTED = "aborted"  # the stream ended before the response did (client or upstream went away)
    REJECTED = "rejected"  # answered by the picker itself (status contract), never dispatched
    UNOBSERVED = "unobserved"  # dispatched, but no observer stream ever reported its end


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    admitted_at: float
    model: str = ""
    stream: bool = False
    body_bytes: int = 0
    picked: tuple[str, ...] = ()
    lease: Lease | None = None
    status: int | None = None
    served: str | None = None
    response_started_at: float | None = None
    observed: bool = False
    ended_at: float | None = None
    end_reason: EndReason | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.end_reason is not None
