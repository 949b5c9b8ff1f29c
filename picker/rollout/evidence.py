"""What one ended request says about the canary group that served it: the gates' `Sample`, built from
the evidence its shape showed (picker/rollout/gates.py `EVIDENCE`). Pure: the caller passes the clock.
"""

from __future__ import annotations

from picker.rollout.gates import CUT, Sample
from picker.streams import EndReason, RequestRecord

# ends that say nothing of the model server: not a sample (an `unobserved` one still gives its
# status, where response headers reached the picker)
NOT_A_SAMPLE = frozenset({EndReason.CLIENT_DISCONNECT, EndReason.REJECTED, EndReason.SHUTDOWN_CUT})


def sample_of(record: RequestRecord, reason: EndReason, now: float) -> Sample | None:
    """The request's sample, with None for what its shape did not show; None when it says nothing."""
    if reason in NOT_A_SAMPLE:
        return None
    tracker = record.tracker
    first = tracker.first_byte_at if tracker is not None else None
    sent = record.lease.picked_at if record.lease is not None else record.admitted_at
    itl = None
    if (
        tracker is not None
        and first is not None
        and tracker.last_chunk_at is not None
        and tracker.token_chunks > 1
    ):
        itl = (tracker.last_chunk_at - first) / (tracker.token_chunks - 1)
    if reason is EndReason.UNOBSERVED:  # its end unseen: only its status, if that came
        if not record.status:
            return None
        cut, error = None, record.status >= 500 and first is None
    else:
        cut, error = reason in CUT, reason is EndReason.UPSTREAM_ERROR_STATUS
    # TTFT from its dispatch: time in the picker's queue is no fault of the group's
    return Sample(now, cut=cut, error=error, ttft_s=None if first is None else first - sent, itl_s=itl)
