"""Read the three engine gauges the scheduler needs out of a model server's /metrics page, and the
two info series cache-aware routing reads when the engine has them: `vllm:cache_config_info` (the
KV block size and the number of blocks) and `vllm:lora_requests_info` (running and waiting LoRA
adapters, and `max_lora`; the series with the newest value wins, as the reference picker reads it).

The gauge names are vLLM's by default; `ENGINES` holds the presets (vLLM, SGLang: the names the
GIE model-server protocol lists) and `gauge_names` applies the configured preset and overrides.

Only the lines of those gauges reach prometheus-client's text parser: a vLLM page is mostly
histograms, and parsing all of it on every scrape of every endpoint would cost more than the rest
of the picker. Anything odd (missing gauges, NaN, negative values, unparsable lines) is an error,
so the endpoint counts as saturated rather than idle.

A model server's page must never stall the picker's event loop, whatever it holds: `GaugeScanner`
reads the page a chunk at a time as it arrives (a search over each chunk's complete lines, in
C), keeps at most `max_lines` gauge lines of at most `MAX_LINE_BYTES` each, and gives up as
soon as a page has more; only those few lines are parsed at the end.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from picker.config.model import LoadConfig

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
CACHE_INFO = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"

# A protocol bound, not a tunable: a real gauge line is a name, a few labels and a number.
MAX_LINE_BYTES = 4096

_LINE_PREFIXES = (b"", b"# HELP ", b"# TYPE ")


@dataclass(frozen=True, slots=True)
class GaugeNames:
    """Which gauges of a page say how busy the engine is (all three are required)."""

    running: str
    waiting: str
    kv_usage: str  # a 0-1 fraction
    cache_info: str = CACHE_INFO  # optional: read when present
    lora_info: str = LORA_INFO  # optional: read when present

    @property
    def all(self) -> tuple[str, ...]:
        return (self.running, self.waiting, self.kv_usage, self.cache_info, self.lora_info)


# Engine facts, not tunables: the names each engine's /metrics page uses.
VLLM = GaugeNames(RUNNING, WAITING, KV_USAGE)
SGLANG = GaugeNames("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage")
ENGINES: dict[str, GaugeNames] = {"vllm": VLLM, "sglang": SGLANG}


def gauge_names(config: LoadConfig) -> GaugeNames:
    """The configured engine's preset, with any gauge named in the config in its place."""
    preset = ENGINES[config.engine]
    return GaugeNames(
        config.running_gauge or preset.running,
        config.waiting_gauge or preset.waiting,
        config.kv_gauge or preset.kv_usage,
        preset.cache_info,
        config.lora_info_metric or preset.lora_info,
    )


@functools.lru_cache(maxsize=16)
def _name_pattern(names: GaugeNames) -> re.Pattern[bytes]:
    """Searched for anywhere (a literal common prefix: fast), then kept only at the start of a line,
    alone or after "# HELP " / "# TYPE ". An anchored multi-line regex tries every byte and costs 8x more.
    """
    encoded = [n.encode() for n in names.all]
    prefix = min(encoded)
    while not all(n.startswith(prefix) for n in encoded):
        prefix = prefix[:-1]
    rests = b"|".join(re.escape(n[len(prefix) :]) for n in encoded)
    return re.compile(re.escape(prefix) + b"(?:" + rests + rb")[{ ]")


class MetricsPageError(ValueError):
    """The page does not say how busy the engine is."""


@dataclass(frozen=True, slots=True)
class Adapters:
    """LoRA adapters on one engine (vllm:lora_requests_info)."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int


@dataclass(frozen=True, slots=True)
class EngineGauges:
    running: float  # summed over engines
    waiting: float  # summed over engines
    kv_usage: float  # the fullest engine's, 0-1
    block_size: int | None = None  # vllm:cache_config_info, when the page has it
    num_blocks: int | None = None
    adapters: Adapters | None = None  # vllm:lora_requests_info, when the page has it


class GaugeScanner:
    """Incremental: `feed()` each chunk of a page as it arrives, then `result()`.

    Each call costs at most one search over the chunk plus a carried partial line. A line longer
    than `MAX_LINE_BYTES` is skipped unread, or is an error if it is a gauge line.
    """

    def __init__(self, max_lines: int, names: GaugeNames = VLLM) -> None:
        self._max_lines = max_lines
        self._names = names
        self._pattern = _name_pattern(names)
        self._head = len(b"# HELP ") + max(len(n) for n in names.all) + 1
        self._lines: list[bytes] = []
        self._carry = bytearray()  # a partial last line, at most MAX_LINE_BYTES
        self._skipping = False  # inside a line too long to keep

    def feed(self, chunk: bytes) -> None:
        """Scan the complete lines in `chunk`; MetricsPageError once the page has too many gauge lines."""
        start = 0
        if self._skipping:
            newline = chunk.find(b"\n")
            if newline < 0:
                return
            start, self._skipping = newline + 1, False
        end = chunk.rfind(b"\n") + 1
        if end <= start:
            self._keep(chunk[start:])
            return
        block = chunk[start:end]
        if self._carry:
            block = bytes(self._carry) + block
            self._carry.clear()
        self._scan(block)
        self._keep(chunk[end:])

    def result(self) -> EngineGauges:
        """The gauges of the page fed so far (all of it); MetricsPageError when they are not all there."""
        if self._carry and not self._skipping:
            self._scan(bytes(self._carry))
            self._carry.clear()
        return _parse(self._lines, self._names)

    def _keep(self, tail: bytes) -> None:
        if self._skipping:
            return
        if len(self._carry) + len(tail) > MAX_LINE_BYTES:
            head = self._head
            if self._starts_a_gauge_line((bytes(self._carry[:head]) + tail[:head])[:head]):
                raise MetricsPageError(f"a gauge line over {MAX_LINE_BYTES} bytes")
            self._carry.clear()
            self._skipping = True
        else:
            self._carry += tail

    def _scan(self, block: bytes) -> None:
        """Collect the gauge lines of `block` (whole lines); each line is looked at once."""
        position = 0
        while (match := self._pattern.search(block, position)) is not None:
            start = block.rfind(b"\n", 0, match.start()) + 1
            end = block.find(b"\n", match.end())
            position = end = len(block) if end < 0 else end
            if block[start : match.start()] not in _LINE_PREFIXES:
                continue  # the name inside some other line
            if end - start > MAX_LINE_BYTES:
                raise MetricsPageError(f"a gauge line over {MAX_LINE_BYTES} bytes")
            self._lines.append(block[start:end])
            if len(self._lines) > self._max_lines:
                raise MetricsPageError(f"more than {self._max_lines} gauge lines")

    def _starts_a_gauge_line(self, head: bytes) -> bool:
        return any(
            head.startswith(p) and self._pattern.match(head, len(p)) is not None for p in _LINE_PREFIXES
        )


_DEFAULT_MAX_LINES: int = LoadConfig.model_fields["max_gauge_lines"].default


def parse_engine_gauges(
    page: bytes, max_lines: int = _DEFAULT_MAX_LINES, names: GaugeNames = VLLM
) -> EngineGauges:
    """The gauges of a whole page in memory (the scraper feeds a `GaugeScanner` as the page arrives)."""
    scanner = GaugeScanner(max_lines, names)
    scanner.feed(page)
    return scanner.result()


def _parse(wanted: list[bytes], names: GaugeNames) -> EngineGauges:
    try:
        text = b"\n".join(wanted).decode("utf-8")
        families = list(text_string_to_metric_families(text + "\n"))
    except (UnicodeDecodeError, ValueError, TypeError, IndexError) as exc:
        raise MetricsPageError(f"unparsable gauge lines: {exc}") from exc
    found: dict[str, list[float]] = {names.running: [], names.waiting: [], names.kv_usage: []}
    block_size = num_blocks = None
    adapters: tuple[float, Adapters] | None = None
    for family in families:
        for sample in family.samples:
            if sample.name in found:
                value = float(sample.value)
                if not math.isfinite(value) or value < 0:
                    raise MetricsPageError(f"{sample.name} is {value}")
                found[sample.name].append(value)
            elif sample.name == names.cache_info:
                block_size = _positive(sample.labels.get("block_size")) or block_size
                num_blocks = _positive(sample.labels.get("num_gpu_blocks")) or num_blocks
            elif sample.name == names.lora_info:
                seen = _adapters(sample.labels)
                if seen is not None and (adapters is None or float(sample.value) >= adapters[0]):
                    adapters = (float(sample.value), seen)
    missing = [name for name, values in found.items() if not values]
    if missing:
        raise MetricsPageError(f"missing {', '.join(missing)}")
    kv = max(found[names.kv_usage])
    if kv > 1.0:
        raise MetricsPageError(f"{names.kv_usage} is {kv}, above 1")
    return EngineGauges(
        sum(found[names.running]),
        sum(found[names.waiting]),
        kv,
        block_size,
        num_blocks,
        adapters[1] if adapters is not None else None,
    )


def _positive(text: str | None) -> int | None:
    """A label's positive integer, or None (absent, "None", garbage: the info is optional)."""
    if text is None or not text.isdigit():
        return None
    return int(text) or None


def _adapters(labels: dict[str, str]) -> Adapters | None:
    max_lora = _positive(labels.get("max_lora"))
    if max_lora is None:
        return None

    def names(key: str) -> frozenset[str]:
        return frozenset(name for name in labels.get(key, "").split(",") if name)

    return Adapters(names("running_lora_adapters"), names("waiting_lora_adapters"), max_lora)
