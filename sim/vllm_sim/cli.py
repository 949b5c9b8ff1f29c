"""`python -m vllm_sim`: run one or more simulated vLLM replicas in one process (uvloop).

Prints `sim listening HOST:PORT` once per replica when it accepts connections. The first SIGTERM (or
SIGINT) shuts every replica down like vLLM 0.32 (see --shutdown-timeout); the process exits 0 once all
replicas stopped. A second signal exits at once with status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence

from vllm_sim.config import (
    AbortStyle,
    CacheConfig,
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
from vllm_sim.replica import Replica, nth

EPILOG = """\
per-request headers: x-sim-ttft-ms, x-sim-itl-ms (floats), x-sim-max-tokens (exactly N tokens),
  x-sim-fault (e.g. 'status=429', 'error-after=3,slow-headers=100'), x-request-id (request log id).
admin API per replica: POST /sim/shutdown {"timeout": N, "on_drain_timeout": "hang|abort", "force": bool};
  GET|POST|DELETE /sim/faults; GET|DELETE /sim/requests; GET /sim/state; POST /sim/health {"status": N};
  POST /sim/kv/pull (a decode's KV pull from a prefill).
every response carries x-sim-replica: HOST:PORT.
"""


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after each option, and the epilog's lines kept as written."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_sim",
        description="vLLM-compatible model-server simulator (OpenAI completions/chat, SSE, /metrics, "
        "vLLM 0.32 shutdown behaviour, fault injection). One process can serve several replicas.",
        formatter_class=_Formatter,
        epilog=EPILOG,
    )
    server = parser.add_argument_group("server")
    server.add_argument(
        "--port",
        type=int,
        action="append",
        required=True,
        help="port of one replica; repeat for several replicas (0 = any free port)",
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default="tiny-llama",
        help="served model name (others get vLLM's 404)",
    )
    server.add_argument(
        "--request-log-size",
        type=int,
        default=10_000,
        help="entries kept in each replica's request log (GET /sim/requests)",
    )
    server.add_argument(
        "--log-requests",
        action="store_true",
        help="log one line per finished request (ids, outcome, counts; never text)",
    )
    server.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level of the simulator's own log (stderr)",
    )

    latency = parser.add_argument_group("latency model")
    latency.add_argument(
        "--ttft-ms",
        type=float,
        default=20.0,
        help="fixed time to first token, counted from getting a running slot",
    )
    latency.add_argument(
        "--ttft-per-prompt-token-ms", type=float, default=0.0, help="extra TTFT per prompt token (prefill)"
    )
    latency.add_argument("--itl-ms", type=float, default=10.0, help="inter-token latency")
    latency.add_argument(
        "--itl-per-running-ms",
        type=float,
        default=0.0,
        help="each other running request adds this to every inter-token step (batch size cost)",
    )
    latency.add_argument("--ttft-jitter-ms", type=float, default=0.0, help="TTFT jitter, uniform +-j")
    latency.add_argument(
        "--itl-jitter-ms",
        type=float,
        default=0.0,
        help="per-token deadline jitter, uniform +-j, never accumulating",
    )
    latency.add_argument(
        "--tokens-per-chunk",
        type=int,
        default=1,
        help="tokens per SSE chunk after the first (vLLM's stream interval)",
    )
    latency.add_argument(
        "--eos-rate",
        type=float,
        default=0.0,
        help="share of requests without ignore_eos that stop early (finish_reason stop) "
        "at a seeded length below max_tokens",
    )
    latency.add_argument("--seed", type=int, default=0, help="seed of the per-request random draws")

    capacity = parser.add_argument_group("capacity model")
    capacity.add_argument("--max-num-seqs", type=int, default=256, help="running slots")
    capacity.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=None,
        help="waiting-queue bound, beyond it HTTP 503; unset = unbounded",
    )
    capacity.add_argument(
        "--kv-capacity-tokens",
        type=int,
        default=131072,
        help="KV cache size in tokens; usage = (prompt + generated tokens of running requests) / this",
    )
    capacity.add_argument(
        "--max-model-len", type=int, default=8192, help="prompt + max_tokens above this gets vLLM's 400"
    )
    capacity.add_argument(
        "--default-max-tokens", type=int, default=16, help="max_tokens of a request that sets none"
    )

    cache = parser.add_argument_group("prefix cache, prefill, KV events and LoRA (sim/vllm_sim/prefix.py)")
    cache.add_argument(
        "--no-enable-prefix-caching",
        dest="prefix_caching",
        action="store_false",
        help="turn vLLM's automatic prefix caching off",
    )
    cache.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    cache.add_argument(
        "--num-gpu-blocks",
        "--num-gpu-blocks-override",
        dest="num_gpu_blocks",
        type=int,
        default=None,
        help="blocks the prefix cache holds (default: --kv-capacity-tokens / --block-size)",
    )
    cache.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="prefill as a shared compute: uncached prompt tokens at this rate, one request after another",
    )
    cache.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens in responses",
    )
    cache.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="a usage chunk at the end of every stream, asked for or not",
    )
    cache.add_argument(
        "--kv-events-port",
        type=int,
        action="append",
        default=None,
        help="publish KV-cache events on tcp://HOST:PORT (ZMQ PUB), one per replica in --port order",
    )
    cache.add_argument("--lora-modules", nargs="+", default=(), help="LoRA adapter names served")
    cache.add_argument("--max-loras", type=int, default=1, help="adapters active at once")
    cache.add_argument("--lora-load-ms", type=float, default=0.0, help="TTFT added when an adapter loads")

    shutdown = parser.add_argument_group("shutdown (SIGTERM or POST /sim/shutdown)")
    shutdown.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="0 = abort mode (listener closes, streams cut at once); N > 0 = drain mode "
        "(in-flight requests finish, new ones get HTTP 500, /health stays 200, for up to N s)",
    )
    shutdown.add_argument(
        "--abort-style",
        choices=[s.value for s in AbortStyle],
        default="abort",
        help="how abort mode ends in-flight streams: finish_reason abort + [DONE], the "
        "EngineCore error event + [DONE], or a hang",
    )
    shutdown.add_argument(
        "--on-drain-timeout",
        choices=[a.value for a in DrainTimeoutAction],
        default="hang",
        help="streams still running when the drain timeout expires: hang (as vLLM) or abort",
    )
    shutdown.add_argument(
        "--post-drain-close-s",
        type=float,
        default=0.5,
        help="delay between the end of the drain and the listener closing (vLLM: 3-4 s)",
    )
    shutdown.add_argument(
        "--hang-limit-s",
        type=float,
        default=120.0,
        help="a hanging connection is closed after this, so the process can exit",
    )

    disagg = parser.add_argument_group(
        "prefill/decode disaggregation, as vLLM's NixlConnector (sim/vllm_sim/disagg.py)"
    )
    disagg.add_argument(
        "--role",
        action="append",
        choices=[r.value for r in Role],
        default=None,
        help="each replica's role in --port order (vLLM's kv_role; reported, gates nothing, as in vLLM); "
        "replicas beyond the list: both",
    )
    disagg.add_argument(
        "--kv-engine-id",
        action="append",
        default=None,
        help="each replica's engine id in --port order (unset: a fresh uuid4, as vLLM)",
    )
    disagg.add_argument(
        "--kv-transfer-ms", type=float, default=0.0, help="fixed part of one KV pull (decode side)"
    )
    disagg.add_argument(
        "--kv-transfer-per-block-ms", type=float, default=0.0, help="each KV block pulled adds this"
    )
    disagg.add_argument(
        "--kv-lease-s",
        type=float,
        default=30.0,
        help="a prefill frees blocks never pulled after this (vLLM's kv_lease_duration)",
    )
    disagg.add_argument(
        "--kv-load-failure-policy",
        choices=[p.value for p in KvLoadFailurePolicy],
        default="fail",
        help="a decode whose pull failed: fail (vLLM's default: HTTP 500 / in-stream error) or recompute",
    )

    disagg.add_argument(
        "--pd-sidecar",
        action="store_true",
        help="act as llm-d's routing sidecar too: a request naming x-prefiller-host-port is prefilled "
        "there first, then decoded here",
    )

    faults = parser.add_argument_group("fault injection (also per request: header x-sim-fault)")
    faults.add_argument(
        "--fault",
        default=None,
        help="server-wide fault, e.g. 'status=503', 'reset-after=5', 'error-after=3', "
        "'stall-after=2', 'slow-headers=200'",
    )
    faults.add_argument(
        "--fault-count",
        type=int,
        default=None,
        help="apply --fault to the next K requests only; unset = to all",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """Build the config; raises ValueError naming the bad field."""
    fault: FaultSpec | None = parse_fault_header(args.fault) if args.fault else None
    return SimConfig(
        model=args.model,
        host=args.host,
        latency=LatencyConfig(
            ttft_ms=args.ttft_ms,
            ttft_per_prompt_token_ms=args.ttft_per_prompt_token_ms,
            itl_ms=args.itl_ms,
            itl_per_running_ms=args.itl_per_running_ms,
            ttft_jitter_ms=args.ttft_jitter_ms,
            itl_jitter_ms=args.itl_jitter_ms,
            tokens_per_chunk=args.tokens_per_chunk,
            eos_rate=args.eos_rate,
            seed=args.seed,
        ),
        capacity=CapacityConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_queued_reqs=args.max_num_queued_reqs,
            kv_capacity_tokens=args.kv_capacity_tokens,
            max_model_len=args.max_model_len,
            default_max_tokens=args.default_max_tokens,
        ),
        cache=CacheConfig(
            prefix_caching=args.prefix_caching,
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            prompt_tokens_details=args.enable_prompt_tokens_details,
            force_include_usage=args.enable_force_include_usage,
            lora_modules=tuple(args.lora_modules),
            max_loras=args.max_loras,
            lora_load_ms=args.lora_load_ms,
        ),
        shutdown=ShutdownConfig(
            timeout_s=args.shutdown_timeout,
            abort_style=AbortStyle(args.abort_style),
            on_drain_timeout=DrainTimeoutAction(args.on_drain_timeout),
            post_drain_close_s=args.post_drain_close_s,
            hang_limit_s=args.hang_limit_s,
        ),
        disagg=DisaggConfig(
            transfer_ms=args.kv_transfer_ms,
            transfer_per_block_ms=args.kv_transfer_per_block_ms,
            kv_lease_s=args.kv_lease_s,
            load_failure_policy=KvLoadFailurePolicy(args.kv_load_failure_policy),
            sidecar=args.pd_sidecar,
        ),
        faults=fault,
        fault_count=args.fault_count,
        request_log_size=args.request_log_size,
        log_requests=args.log_requests,
    )


async def serve(
    config: SimConfig,
    ports: Sequence[int],
    kv_events_ports: Sequence[int] = (),
    roles: Sequence[Role] = (),
    engine_ids: Sequence[str] = (),
) -> int:
    loop = asyncio.get_running_loop()
    replicas = [
        Replica(config, port, nth(kv_events_ports, i), nth(roles, i), nth(engine_ids, i))
        for i, port in enumerate(ports)
    ]
    started: list[Replica] = []
    signals_seen = 0

    def on_signal() -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen == 1:
            for replica in started:
                replica.begin_shutdown()
            return
        print("sim: second signal, exiting now", file=sys.stderr, flush=True)
        os._exit(1)

    # Handlers first: a parent may signal as soon as it reads the first "listening" line.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal)
    for replica in replicas:
        if signals_seen:
            break  # shutting down before every replica was up: start no more
        await replica.start()
        started.append(replica)
        print(f"sim listening {replica.address}", flush=True)
        if signals_seen:
            replica.begin_shutdown()
    await asyncio.gather(*(replica.wait_stopped() for replica in started))
    print("sim stopped", flush=True)
    return 0


def _raise_open_file_limit() -> None:
    """Thousands of concurrent streams need thousands of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    for name in ("kv_events_port", "role", "kv_engine_id"):
        if getattr(args, name) and len(getattr(args, name)) > len(args.port):
            parser.error(f"more --{name.replace('_', '-')} than --port")
    if args.kv_engine_id and not all(args.kv_engine_id):
        parser.error("--kv-engine-id: must not be empty")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _raise_open_file_limit()
    import uvloop

    roles = [Role(r) for r in args.role or ()]
    return uvloop.run(serve(config, args.port, args.kv_events_port or (), roles, args.kv_engine_id or ()))
