"""Per-request records and their lifecycle: admitted -> routed -> committed -> ended.

The first response byte is the commit point: from then on nothing may retry or re-route the
request. Every request ends with exactly one `EndReason`, settled from what flowed in the body
(`ResponseTracker`, an incremental SSE parser that decodes only what it must) and, when the body
cannot tell who cut a stream, from Envoy's access log (`classify`). No transport code here.
"""

from picker.streams.classify import from_access_log, from_body
from picker.streams.record import Attempts, EndReason, RequestRecord
from picker.streams.sse import SSEEvent, SSEParser
from picker.streams.tracker import ResponseTracker

__all__ = [
    "Attempts",
    "EndReason",
    "RequestRecord",
    "ResponseTracker",
    "SSEEvent",
    "SSEParser",
    "from_access_log",
    "from_body",
]
