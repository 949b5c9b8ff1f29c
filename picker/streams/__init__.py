"""Per-request records and their lifecycle: admitted -> routed -> response started -> ended.

Every request the picker sees ends with exactly one `EndReason`. No transport code here: the
frontends report what they observe (response headers, body chunks, stream ends) in core terms.
"""

from picker.streams.record import EndReason, RequestRecord

__all__ = ["EndReason", "RequestRecord"]
