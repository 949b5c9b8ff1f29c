"""The reference endpoint picker's metric names (Gateway API Inference Extension), beside the picker's own.

A team that swaps the reference's image for this one keeps its dashboards and alerts: the names, types
and label names are the reference's. One recording per fact: a fact the picker already records (time to
first token, admission-and-pick time, queue wait, queue size, per-replica engine gauges) is read from
that recording, or from the pool, when /metrics is scraped and shown again under the reference's name
(its buckets are then the picker's: `views`); a fact the picker did not record before (requests and
errors by model, request duration, sizes, token counts, time per output token) is recorded once, as
plain numbers per model, and shown under the reference's name when /metrics is read (`recorded`), the
picker's own name derived from it where it has one (`picker_output_tokens_total` is the `_sum` of
`inference_objective_output_tokens`).

The pool's saturation is the reference's figure, not `picker_pool_saturation` (demand over ready slots,
unknown while a replica's slot count is): the mean over READY replicas of the larger of engine queue
over `load.waiting_threshold` and KV-cache usage over `load.kv_threshold`, a replica without fresh
figures counting 1, no READY replica 1. It is read from the pool at scrape time, with the thresholds
the pick calls an engine saturated by, so it answers whenever the engines are scraped.

Labels as the reference sets them. The picker rewrites no model names, so `target_model_name` is
`model_name`; model names come from requests and are capped as the picker's own (`other` past the cap).
"""

from picker.observability.reference.recorded import ERROR_CODES, ReferenceSeries
from picker.observability.reference.views import QUEUE_OUTCOMES, ReferenceViews, build_commit, pool_saturation

__all__ = [
    "ERROR_CODES",
    "QUEUE_OUTCOMES",
    "ReferenceSeries",
    "ReferenceViews",
    "build_commit",
    "pool_saturation",
]
