"""The facts the picker records only under the reference's names: requests by model and priority,
refusals by the reference's error code, and per request its duration, sizes, prompt and output tokens
and time per output token. Plain numbers per model on the request path; families when /metrics is read."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from picker.contract import Outcome

# The reference's buckets for the facts recorded here (pkg/epp/metrics/metrics.go).
LATENCY_BUCKETS = (
    *(0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20, 30),
    *(45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600),
)
TPOT_BUCKETS = (
    *(0.0005, 0.00205, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.125, 0.15, 0.2, 0.3, 0.4, 0.5),
    *(0.6, 0.8, 1, 1.5, 2, 3, 4.5, 6, 12, 18, 24, 30, 36, 48, 60, 90, 120, 180, 270, 360),
)
REQUEST_SIZE_BUCKETS = tuple(float(2**n) for n in range(6, 31))  # 64 B .. 1 GiB
RESPONSE_SIZE_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778, 65536)
INPUT_TOKEN_BUCKETS = (*(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32778), 65536)
INPUT_TOKEN_BUCKETS += (131072, 262144, 524288, 1048576)
OUTPUT_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

_MODEL = ["model_name", "target_model_name"]

# The reference's error_code (its error package's codes) for each refusal of the status contract.
ERROR_CODES: dict[Outcome, str] = {
    Outcome.REJECTED_SATURATED: "ResourceExhausted",
    Outcome.REJECTED_TTL_EXPIRED: "ResourceExhausted",
    Outcome.REJECTED_NO_ENDPOINTS: "ServiceUnavailable",
    Outcome.REJECTED_SHUTTING_DOWN: "ServiceUnavailable",
    Outcome.REJECTED_CONTEXT_CANCELLED: "Unknown",
    Outcome.REJECTED_MODEL_NOT_SERVED: "NotFound",
    Outcome.REJECTED_CONTEXT_TOO_LONG: "BadRequest",
    Outcome.REJECTED_SLO_UNATTAINABLE: "ResourceExhausted",
    Outcome.REJECTED_OVER_BUDGET: "ResourceExhausted",
    Outcome.BAD_REQUEST: "BadRequest",
    Outcome.TOO_LARGE: "BadRequest",
    Outcome.INTERNAL_ERROR: "Internal",
    Outcome.PICKER_UNAVAILABLE: "ServiceUnavailable",
}


class Labels(Protocol):
    """The picker's capped model labels (metrics.py's _CappedLabels)."""

    def label(self, value: str) -> str: ...


class _Facts:
    """One model's facts as plain numbers: requests by priority, and per histogram its bucket counts
    (not cumulative) and sum. The request path and the scrape run on one event loop, so nothing here
    takes a lock (a prometheus_client child takes two per observation)."""

    __slots__ = ("by_priority", "counts", "sums")

    def __init__(self) -> None:
        self.by_priority: dict[str, int] = {}
        self.counts = [[0] * (len(bounds) + 1) for _, _, bounds in HISTOGRAMS]
        self.sums = [0.0] * len(HISTOGRAMS)


# The histograms recorded here: name (after inference_objective_), help, buckets; index = position.
HISTOGRAMS: tuple[tuple[str, str, tuple[float, ...]], ...] = (
    ("request_duration_seconds", "Admission to the response's end", LATENCY_BUCKETS),
    (
        "request_tpot_seconds",
        "Per request: first token to end over output tokens after the first",
        TPOT_BUCKETS,
    ),
    ("request_sizes", "Request body bytes", REQUEST_SIZE_BUCKETS),
    ("response_sizes", "Response body bytes seen", RESPONSE_SIZE_BUCKETS),
    ("input_tokens", "Prompt tokens (the engine's usage)", INPUT_TOKEN_BUCKETS),
    ("output_tokens", "Output tokens per request (usage, else token chunks)", OUTPUT_TOKEN_BUCKETS),
)
_DURATION, _TPOT, _REQUEST_SIZES, _RESPONSE_SIZES, _INPUT, _OUTPUT = range(len(HISTOGRAMS))
_BOUNDS = tuple(tuple(float(b) for b in bounds) for _, _, bounds in HISTOGRAMS)
_MAX_CACHED_MODELS = 1024  # model names come from requests: the cache of their facts is bounded


class ReferenceSeries(Collector):
    """The facts recorded under the reference's names: one `_Facts` per (capped) model, looked up
    once per request, its numbers shown as counters and histograms when /metrics is read."""

    def __init__(self, registry: CollectorRegistry, models: Labels) -> None:
        self._models = models
        self._facts: dict[str, _Facts] = {}  # by capped label: at most the model cap + "other"
        self._by_model: dict[str, _Facts] = {}  # by the request's model name, bounded
        self.errors = Counter(
            "inference_objective_request_error_total",
            "Requests the picker refused, by model and the reference's error_code",
            [*_MODEL, "error_code"],
            registry=registry,
        )
        registry.register(self)

    def _of(self, model: str) -> _Facts:
        facts = self._by_model.get(model)
        if facts is None:
            label = self._models.label(model)
            facts = self._facts.get(label)
            if facts is None:
                facts = self._facts[label] = _Facts()
            if len(self._by_model) < _MAX_CACHED_MODELS:
                self._by_model[model] = facts
        return facts

    def picked(self, model: str, priority: int) -> None:
        counts = self._of(model).by_priority
        key = str(priority)
        counts[key] = counts.get(key, 0) + 1

    def refused(self, model: str, outcome: Outcome) -> None:
        code = ERROR_CODES.get(outcome)
        if code is not None:
            label = self._models.label(model)
            self.errors.labels(label, label, code).inc()

    def produced(self, model: str, tokens: int) -> None:
        """The tokens one request streamed (`picker_output_tokens_total` is this histogram's sum)."""
        if tokens > 0:
            facts = self._of(model)
            facts.counts[_OUTPUT][bisect_left(_BOUNDS[_OUTPUT], tokens)] += 1
            facts.sums[_OUTPUT] += tokens

    def ended(
        self,
        model: str,
        *,
        duration_s: float,
        request_bytes: int,
        response_bytes: int,
        prompt_tokens: int | None,
        tpot_s: float | None,
    ) -> None:
        """One dispatched request's end, once (its output tokens: `produced`)."""
        facts = self._of(model)
        counts, sums = facts.counts, facts.sums
        for i, amount in (
            (_DURATION, duration_s),
            (_REQUEST_SIZES, request_bytes),
            (_RESPONSE_SIZES, response_bytes),
            (_INPUT, prompt_tokens or None),
            (_TPOT, tpot_s),
        ):
            if amount is not None and amount == amount:  # NaN: dropped (a NaN sum stays NaN)
                counts[i][bisect_left(_BOUNDS[i], amount)] += 1
                sums[i] += amount

    def output_tokens(self) -> Iterator[tuple[str, float]]:
        """(model label, tokens streamed) for each model that streamed any."""
        for label, facts in self._facts.items():
            if sum(facts.counts[_OUTPUT]):
                yield label, facts.sums[_OUTPUT]

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "inference_objective_request",
            "Requests picked for a replica, by model and priority (the reference's count)",
            labels=[*_MODEL, "priority"],
        )
        for label, facts in self._facts.items():
            for priority, count in facts.by_priority.items():
                requests.add_metric([label, label, priority], count)
        yield requests
        for i, (name, doc, _) in enumerate(HISTOGRAMS):
            family = HistogramMetricFamily(f"inference_objective_{name}", doc + ", by model", labels=_MODEL)
            for label, facts in self._facts.items():
                counts = facts.counts[i]
                if not sum(counts):
                    continue
                cumulative, buckets = 0, []
                for bound, count in zip((*_BOUNDS[i], math.inf), counts, strict=True):
                    cumulative += count
                    buckets.append((floatToGoString(bound), float(cumulative)))
                family.add_metric([label, label], buckets, facts.sums[i])
            yield family
