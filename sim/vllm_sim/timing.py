"""The latency model: when each token of a request is due, and how many tokens it gets.

Pure (no I/O, no clock): the handler passes the loop time at which the first token is due and asks for
absolute deadlines `t_first + i * itl + jitter_i`, so lateness of one write never shifts the next ones.

Determinism: each request draws from its own `random.Random(f"{seed}:{key}")`, key = the x-request-id
header when present, else the replica's arrival sequence number.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from vllm_sim.config import LatencyConfig

# Per-request override headers (simulator only).
TTFT_HEADER = "x-sim-ttft-ms"  # float >= 0: fixed TTFT for this request (prompt-size term dropped)
ITL_HEADER = "x-sim-itl-ms"  # float >= 0: inter-token latency for this request
MAX_TOKENS_HEADER = "x-sim-max-tokens"  # int >= 1: exactly this many tokens (max_tokens + ignore_eos)


@dataclass(frozen=True, slots=True)
class Overrides:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    max_tokens: int | None = None


def parse_overrides(headers: Mapping[str, str]) -> Overrides:
    """Read the x-sim-* latency headers; a malformed value is a ValueError naming the header."""
    return Overrides(
        ttft_ms=_header_float(headers, TTFT_HEADER),
        itl_ms=_header_float(headers, ITL_HEADER),
        max_tokens=_header_int(headers, MAX_TOKENS_HEADER),
    )


def _header_float(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number, got {raw!r}") from None
    if not 0 <= value <= 3_600_000:
        raise ValueError(f"{name} must be within [0, 3600000], got {raw!r}")
    return value


def _header_int(headers: Mapping[str, str], name: str) -> int | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {raw!r}")
    return value


class TokenPlan:
    """Timing and length of one request's output."""

    __slots__ = (
        "_jitter_s",
        "_rng",
        "finish_reason",
        "itl_per_running_s",
        "itl_s",
        "output_tokens",
        "per_prompt_token_s",
        "ttft_s",
    )

    def __init__(
        self,
        ttft_s: float,
        itl_s: float,
        output_tokens: int,
        finish_reason: str,
        itl_jitter_s: float,
        rng: random.Random,
        per_prompt_token_s: float = 0.0,
        itl_per_running_s: float = 0.0,
    ) -> None:
        self.ttft_s = ttft_s
        self.per_prompt_token_s = per_prompt_token_s  # in ttft_s per prompt token: cached ones save it
        self.itl_s = itl_s
        self.itl_per_running_s = itl_per_running_s  # added to each step per other running request
        self.output_tokens = output_tokens
        self.finish_reason = finish_reason
        self._jitter_s = itl_jitter_s
        self._rng = rng

    def deadline(self, t_first: float, index: int) -> float:
        """Absolute due time of token `index` (0-based); jitter is bounded and never accumulates."""
        due = t_first + index * self.itl_s
        if self._jitter_s and index:
            due += self._rng.uniform(-self._jitter_s, self._jitter_s)
        return due

    def step_s(self, running: int) -> float:
        """Seconds per token while `running` requests (this one included) share the engine's steps."""
        return self.itl_s + self.itl_per_running_s * max(0, running - 1)


def plan_tokens(
    latency: LatencyConfig,
    key: str,
    prompt_tokens: int,
    max_tokens: int,
    ignore_eos: bool,
    overrides: Overrides,
    min_tokens: int = 0,
) -> TokenPlan:
    rng = random.Random(f"{latency.seed}:{key}")
    if overrides.ttft_ms is not None:
        ttft_ms = overrides.ttft_ms
    else:
        ttft_ms = latency.ttft_ms + latency.ttft_per_prompt_token_ms * prompt_tokens
        if latency.ttft_jitter_ms:
            ttft_ms = max(0.0, ttft_ms + rng.uniform(-latency.ttft_jitter_ms, latency.ttft_jitter_ms))
    itl_ms = overrides.itl_ms if overrides.itl_ms is not None else latency.itl_ms
    if overrides.max_tokens is not None:
        max_tokens, ignore_eos = overrides.max_tokens, True
    output_tokens, finish_reason = max_tokens, "length"
    # The early stop is drawn even when unused, so jitter draws do not depend on ignore_eos.
    stops_early = rng.random() < latency.eos_rate
    natural_length = rng.randint(1, max(1, max_tokens - 1))
    if not ignore_eos and stops_early and max_tokens > 1 and min_tokens < max_tokens:
        # no EOS among the first min_tokens tokens: vLLM's min-tokens logits processor masks it
        output_tokens, finish_reason = max(natural_length, min_tokens + 1), "stop"
    return TokenPlan(
        ttft_s=ttft_ms / 1000,
        itl_s=itl_ms / 1000,
        output_tokens=output_tokens,
        finish_reason=finish_reason,
        itl_jitter_s=latency.itl_jitter_ms / 1000,
        rng=rng,
        per_prompt_token_s=0.0 if overrides.ttft_ms is not None else latency.ttft_per_prompt_token_ms / 1000,
        itl_per_running_s=0.0 if overrides.itl_ms is not None else latency.itl_per_running_ms / 1000,
    )
