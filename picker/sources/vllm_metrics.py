"""Read the three engine gauges the scheduler needs out of a vLLM /metrics page.

Only the lines of those gauges reach prometheus-client's text parser: a vLLM page is mostly
histograms, and parsing all of it on every scrape of every endpoint would cost more than the rest
of the picker. Anything odd (missing gauges, NaN, negative values, unparsable lines) is an error,
so the endpoint counts as saturated rather than idle.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"

_WANTED = re.compile(
    rb"^(?:# (?:HELP|TYPE) )?vllm:(?:num_requests_running|num_requests_waiting|kv_cache_usage_perc)[{ ].*$",
    re.MULTILINE,
)


class MetricsPageError(ValueError):
    """The page does not say how busy the engine is."""


@dataclass(frozen=True, slots=True)
class EngineGauges:
    running: float  # summed over engines
    waiting: float  # summed over engines
    kv_usage: float  # the fullest engine's, 0-1


def parse_engine_gauges(page: bytes) -> EngineGauges:
    lines = b"\n".join(_WANTED.findall(page))
    try:
        text = lines.decode("utf-8")
        families = list(text_string_to_metric_families(text + "\n"))
    except (UnicodeDecodeError, ValueError, TypeError, IndexError) as exc:
        raise MetricsPageError(f"unparsable gauge lines: {exc}") from exc
    found: dict[str, list[float]] = {RUNNING: [], WAITING: [], KV_USAGE: []}
    for family in families:
        for sample in family.samples:
            if sample.name in found:
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    raise MetricsPageError(f"{sample.name} is {value}")
                found[sample.name].append(value)
    missing = [name for name, values in found.items() if not values]
    if missing:
        raise MetricsPageError(f"missing {', '.join(missing)}")
    kv = max(found[KV_USAGE])
    if kv > 1.0:
        raise MetricsPageError(f"{KV_USAGE} is {kv}, above 1")
    return EngineGauges(sum(found[RUNNING]), sum(found[WAITING]), kv)
