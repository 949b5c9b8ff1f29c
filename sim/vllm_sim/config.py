"""The simulator's configuration: one frozen, grouped model with documented defaults.

Invalid values raise `ValueError` naming the field; nothing here exits the process (only `cli.py` does).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from vllm_sim.faults import FaultSpec


class AbortStyle(enum.Enum):
    """How in-flight streams end on an abort-mode shutdown (real vLLM shows all three, racily)."""

    ABORT = "abort"  # last chunk finish_reason "abort" (+ usage when asked) + [DONE]
    ERROR = "error"  # in-stream error event "EngineCore encountered an issue..." + [DONE]
    HANG = "hang"  # no more bytes, connection held open until the client gives up


class DrainTimeoutAction(enum.Enum):
    """What happens to streams still running when --shutdown-timeout expires."""

    HANG = "hang"  # like vLLM: no bytes, connection kept open, listener closed
    ABORT = "abort"  # end them like AbortStyle.ABORT


class Role(enum.Enum):
    """A replica's part in disaggregated serving (vLLM's kv_role with a KV connector).

    vLLM gates nothing on the role: a request's kv_transfer_params decide what it does, on any role; the
    simulator does the same and only reports the role (GET /sim/state)."""

    PREFILL = "prefill"  # kv_producer
    DECODE = "decode"  # kv_consumer
    BOTH = "both"  # kv_both, or no connector: serves plain requests as ever


class KvLoadFailurePolicy(enum.Enum):
    """What a decode does when its KV pull fails (vLLM's kv_transfer_config.kv_load_failure_policy)."""

    FAIL = "fail"  # vLLM's default: the request ends with an error (HTTP 500, or an in-stream error event)
    RECOMPUTE = "recompute"  # the decode computes the whole prompt itself


def _require(condition: bool, name: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{name}: {message}")


@dataclass(frozen=True, slots=True)
class LatencyConfig:
    """Token timing. TTFT counts from the moment a request gets a running slot (queue time adds to it)."""

    ttft_ms: float = 20.0  # fixed part of the time to first token (real vLLM CPU, warm: 16-25 ms)
    ttft_per_prompt_token_ms: float = 0.0  # prefill cost per prompt token
    itl_ms: float = 10.0  # inter-token latency
    # each other request running on the engine adds this to every step (a bigger batch is a longer
    # step; vLLM 0.32 on CPU, tiny model: 1.4 ms per token alone, 2.5 ms with six decoding)
    itl_per_running_ms: float = 0.0
    ttft_jitter_ms: float = 0.0  # bounded jitter: uniform in [-j, +j], TTFT never below 0
    itl_jitter_ms: float = 0.0  # per-token deadline offset, uniform in [-j, +j]; never accumulates
    tokens_per_chunk: int = 1  # tokens batched into one SSE chunk (vLLM's stream interval)
    eos_rate: float = 0.0  # share of requests without ignore_eos that stop early with "stop"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "ttft_ms", "ttft_per_prompt_token_ms", "itl_ms", "ttft_jitter_ms", "itl_jitter_ms",
            "itl_per_running_ms",
        ):  # fmt: skip
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.tokens_per_chunk >= 1, "tokens_per_chunk", "must be >= 1")
        _require(0.0 <= self.eos_rate <= 1.0, "eos_rate", "must be within [0, 1]")


@dataclass(frozen=True, slots=True)
class CapacityConfig:
    """The engine's capacity: running slots, a bounded waiting queue, a KV cache counted in tokens."""

    max_num_seqs: int = 256  # running slots (vLLM --max-num-seqs)
    max_num_queued_reqs: int | None = None  # waiting-queue bound; None = unbounded; beyond it -> 503
    kv_capacity_tokens: int = 131072  # tokens the KV cache holds; usage = held / capacity
    max_model_len: int = 8192  # prompt + max_tokens above this -> 400, as vLLM
    default_max_tokens: int = 16  # when the request has no max_tokens (vLLM's completions default)

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        _require(
            self.max_num_queued_reqs is None or self.max_num_queued_reqs >= 0,
            "max_num_queued_reqs",
            "must be >= 0",
        )
        _require(self.kv_capacity_tokens >= 1, "kv_capacity_tokens", "must be >= 1")
        _require(self.max_model_len >= 2, "max_model_len", "must be >= 2")
        _require(self.default_max_tokens >= 1, "default_max_tokens", "must be >= 1")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Prefix caching, prefill compute, KV events and LoRA adapters (see sim/vllm_sim/prefix.py)."""

    prefix_caching: bool = True  # vLLM's automatic prefix caching (on by default, as in vLLM)
    block_size: int = 16  # tokens per KV block (vLLM's GPU default; its CPU build uses 128)
    num_gpu_blocks: int | None = None  # blocks the cache holds; default kv_capacity_tokens // block_size
    # Prefill as a shared compute resource: each request's uncached prompt tokens take
    # tokens / rate seconds, one request after another (None: the per-token TTFT term only).
    prefill_tokens_per_s: float | None = None
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens (vLLM's flag)
    force_include_usage: bool = False  # a usage chunk in every stream (vLLM --enable-force-include-usage)
    lora_modules: tuple[str, ...] = ()  # adapter names served besides the base model
    max_loras: int = 1  # adapters active at once (vLLM --max-loras)
    lora_load_ms: float = 0.0  # added to the TTFT of a request whose adapter had to be loaded

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", "must be >= 1")
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1, "num_gpu_blocks", "must be >= 1")
        _require(
            self.prefill_tokens_per_s is None or self.prefill_tokens_per_s > 0, "prefill_tokens_per_s", "> 0"
        )
        _require(self.max_loras >= 1, "max_loras", "must be >= 1")
        _require(self.lora_load_ms >= 0, "lora_load_ms", "must be >= 0")


@dataclass(frozen=True, slots=True)
class ShutdownConfig:
    """Shutdown like vLLM 0.32: abort mode when timeout_s == 0, drain mode otherwise."""

    timeout_s: float = 0.0  # vLLM --shutdown-timeout; 0 = abort mode
    abort_style: AbortStyle = AbortStyle.ABORT
    on_drain_timeout: DrainTimeoutAction = DrainTimeoutAction.HANG
    post_drain_close_s: float = 0.5  # after the last stream of a drain, until the listener closes
    hang_limit_s: float = 120.0  # a hung connection is closed after this long, so the process ends

    def __post_init__(self) -> None:
        for name in ("timeout_s", "post_drain_close_s", "hang_limit_s"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")


@dataclass(frozen=True, slots=True)
class DisaggConfig:
    """Prefill/decode disaggregation as vLLM's NixlConnector (pull mode) does it (sim/vllm_sim/disagg.py)."""

    role: Role = Role.BOTH  # the default role of every replica of the process (per replica: Replica(role=))
    engine_id: str | None = None  # kv_transfer_config.engine_id; None = a fresh uuid4 per replica, as vLLM
    transfer_ms: float = 0.0  # fixed part of one KV pull (handshake, notification)
    transfer_per_block_ms: float = 0.0  # each KV block pulled adds this
    # A prefill holds a finished request's blocks until they are pulled or this lease ends (vLLM's
    # kv_connector_extra_config kv_lease_duration, default 30 s)
    kv_lease_s: float = 30.0
    load_failure_policy: KvLoadFailurePolicy = KvLoadFailurePolicy.FAIL
    # run llm-d's routing sidecar's prefill step for requests naming x-prefiller-host-port (sidecar.py)
    sidecar: bool = False

    def __post_init__(self) -> None:
        for name in ("transfer_ms", "transfer_per_block_ms"):
            _require(getattr(self, name) >= 0, name, "must be >= 0")
        _require(self.kv_lease_s > 0, "kv_lease_s", "must be > 0")
        _require(self.engine_id is None or bool(self.engine_id), "engine_id", "must not be empty")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything one replica needs; every replica of a process shares one SimConfig."""

    model: str = "tiny-llama"  # the served model name (vLLM --served-model-name)
    host: str = "127.0.0.1"
    latency: LatencyConfig = field(default_factory=LatencyConfig)
    capacity: CapacityConfig = field(default_factory=CapacityConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    shutdown: ShutdownConfig = field(default_factory=ShutdownConfig)
    disagg: DisaggConfig = field(default_factory=DisaggConfig)
    faults: FaultSpec | None = None  # a server-wide fault for completion requests
    fault_count: int | None = None  # apply `faults` to the next K requests only; None = to all
    request_log_size: int = 10_000
    log_requests: bool = False  # one log line per finished request (ids, outcome, counts; never text)

    def __post_init__(self) -> None:
        _require(bool(self.model), "model", "must not be empty")
        _require(self.request_log_size >= 1, "request_log_size", "must be >= 1")
        _require(self.fault_count is None or self.fault_count >= 1, "fault_count", "must be >= 1")
