"""A vLLM-compatible model-server simulator (vLLM 0.32 behaviour, measured: shared/reference/vllm*.md).

Run: `python -m vllm_sim --port P [--port P2 ...] [options]` (`--help` lists every option), or in
process (any asyncio loop):

    async with run_sim(SimConfig(shutdown=ShutdownConfig(timeout_s=5)), ports=[0, 0]) as replicas:
        replicas[0].url, replicas[0].state.engine, replicas[0].begin_shutdown()

Modules: config (SimConfig), openai_format (wire format), sampling (stop strings, stop token ids,
min_tokens, logprobs on the greedy tokens of prefix), sampled_stream (the chunks of streams that use
them or return_token_ids), timing (latency model), engine (slots, queue, KV), faults, metrics,
requestlog, state (one replica's shared state), handlers (completion requests), endings (how their
responses end), admin (the other routes), disagg (prefill/decode hand-off), sidecar (llm-d's routing
sidecar's prefill step), replica (lifecycle, shutdown), cli.

Prefill/decode pairs (vLLM's NixlConnector, pull mode): `run_sim(config, ports=[0, 0],
roles=[Role.PREFILL, Role.DECODE])` or `--port P --port D --role prefill --role decode`; the options
and what is and is not modelled are in sim/README.md.

Concurrency model: one event loop, no threads, no locks; every request is its aiohttp handler task; the
replica wakes requests through `InFlight`, it never cancels tasks it did not create.
"""

from vllm_sim.config import (
    AbortStyle,
    CapacityConfig,
    DisaggConfig,
    DrainTimeoutAction,
    KvLoadFailurePolicy,
    LatencyConfig,
    Role,
    ShutdownConfig,
    SimConfig,
)
from vllm_sim.faults import FaultSpec, parse_fault_header
from vllm_sim.replica import Replica, run_sim
from vllm_sim.requestlog import Outcome

__all__ = [
    "AbortStyle",
    "CapacityConfig",
    "DisaggConfig",
    "DrainTimeoutAction",
    "FaultSpec",
    "KvLoadFailurePolicy",
    "LatencyConfig",
    "Outcome",
    "Replica",
    "Role",
    "ShutdownConfig",
    "SimConfig",
    "parse_fault_header",
    "run_sim",
]
