"""The hot path's cost ledger (issue 56): the picker's CPU per request and per chunk, feature by feature.

One run measures, over the same three simulated replicas (each also publishing KV events), one row
per configuration, each with its own Envoy + `picker serve` (or `picker proxy`) started only for it:

  shipped      the shipped configuration (prefix affinity approximate, scraping, flow control,
               affinity.latency auto)
  prefix-off   prefix affinity off (load alone): what approximate affinity costs
  precise      prefix affinity precise (the engines' KV events, token ids from /tokenize)
  latency      affinity.latency on: the per-replica latency model, every candidate predicted
  latency-off  affinity.latency off: what the default `auto` (learning, predictions off on a uniform
               pool) costs over no model at all
  rollout      a canary in its first step (one replica the candidate): the rollout gates
  tracing      --tracing: a trace per request, exported over OTLP to a collector on loopback
  plain        one picker, plaintext Envoy -> picker hop (the reference for `peers`)
  full-duplex  Envoy AI Gateway's shape: one ext_proc filter, bodies FULL_DUPLEX_STREAMED both ways
               (plaintext, as `plain`): every chunk of every stream waits on the picker's echo
  peers        two pickers sharing one set of books (plaintext): both pickers' CPU counted
  proxy        `picker proxy`, resume off
  resume       `picker proxy`, streams.resume greedy (every request greedy, so every one resumable)
  python-gc    the shipped configuration with Python's own garbage collector (server.gc_gen0_threshold
               0): what settling the collector saves
  fair-share-off  tenants.fair_share off, requests without the fairness header as in every other
               row: beside `shipped` (fair share on), what fair share costs a request that has none
  tenant-header  the shipped configuration, every request with the fairness header (one of four
               tenants, in turn): a tenant's accounting (reserved at admission, settled at the end)

Per row, in interleaved rounds (this machine drifts 10-20 % over minutes): a closed loop of one-token
streams at `--concurrency` (picker CPU per request), then of `--tokens`-token streams; the per-chunk
figure is the marginal one, (CPU of the long streams - CPU of the one-token ones) / extra chunks.
Medians over the rounds, printed beside the figures recorded in `loadtest/ledger.json` (the last
release's, written by `--record`). CPU is per-process user + system time from /proc, less the
process's idle rate. Bounded: every loop stops at its count or its seconds; about 4 minutes.
Run: `python -m loadtest.bench_ledger [--record]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_cost import Meter, closed_loop, idle_rates, load
from loadtest.otlp_collector import Collector
from loadtest.procs import Proc, free_port
from loadtest.proxy_stack import ProxyStack
from loadtest.stack import Stack, StackOptions, health_ok, sim_argv

LEDGER = Path(__file__).with_name("ledger.json")
KV_OFFSET = 1000
LABEL = "app.kubernetes.io/version"
SIM_ARGS = ("--ttft-ms", "2", "--itl-ms", "2", "--max-model-len", "1000000")


FAIRNESS = "x-gateway-inference-fairness-id"
TENANTS = ("acme", "globex", "initech", "umbrella")


def request(tokens: int, port: int, tenant: str | None = None) -> bytes:
    body = json.dumps(
        {
            "model": "tiny-llama",
            "prompt": "hi there",
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"connection: close\r\ncontent-length: {len(body)}\r\n"
        + (f"{FAIRNESS}: {tenant}\r\n" if tenant else "")
        + "\r\n"
    )
    return head.encode() + body


@dataclass
class Row:
    name: str
    port: int
    pids: tuple[int, ...]
    idle: float = 0.0


@contextmanager
def rows(workdir: Path, replicas: list[str], names: list[str]) -> Iterator[list[Row]]:
    """Every row's stack, started; stopped (by PID) on the way out."""
    with ExitStack() as stack:
        collector = stack.enter_context(_collector()) if "tracing" in names else None
        out: list[Row] = []
        for name in names:
            folder = workdir / name
            folder.mkdir()
            started = _start(name, folder, replicas, collector)
            stack.callback(started.stop)
            pickers = tuple(p.pid for p in started.pickers if p is not None)
            if not pickers and started.picker is not None:
                pickers = (started.picker.pid,)
            out.append(Row(name, started.listen_port, pickers))
        yield out


@contextmanager
def _collector() -> Iterator[Collector]:
    collector = Collector().start()
    try:
        yield collector
    finally:
        collector.stop()


def _start(name: str, folder: Path, replicas: list[str], collector: Collector | None) -> Stack:
    base: dict[str, Any] = {"replicas": 0, "picker_endpoints": replicas}
    env: dict[str, str] = {}
    args: tuple[str, ...] = ()
    match name:
        case "prefix-off":
            env["PICKER_AFFINITY__PREFIX"] = "off"
        case "precise":
            args = ("--prefix-affinity", "precise", "--kv-events-port-offset", str(KV_OFFSET))
        case "latency":
            env["PICKER_AFFINITY__LATENCY"] = "true"
        case "latency-off":
            env["PICKER_AFFINITY__LATENCY"] = "off"
        case "rollout":
            endpoints, config = folder / "endpoints.json", folder / "picker.json"
            listed = [
                {"address": a, "labels": {LABEL: "v2" if i == 0 else "v1"}} for i, a in enumerate(replicas)
            ]
            endpoints.write_text(json.dumps(listed))
            rollout = {"group_label": LABEL, "stable": "v1", "candidate": "v2", "step_interval_s": 3600}
            config.write_text(json.dumps({"pool": {"endpoints_file": str(endpoints)}, "rollout": rollout}))
            base.update(static_endpoints=False, extra_envoy_endpoints=())
            args = ("--config", str(config))
        case "tracing":
            assert collector is not None
            args = ("--tracing",)
            env.update(OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true")
        case "plain":
            base.update(envoy_picker_tls=False)
        case "full-duplex":  # its cluster lists the pool itself (no EDS in that shape)
            base.update(envoy_picker_tls=False, shape="aigw-failopen", extra_envoy_endpoints=tuple(replicas))
        case "peers":
            base.update(pickers=2, peers=True, envoy_picker_tls=False)
        case "resume":
            env["PICKER_STREAMS__RESUME"] = "greedy"
        case "python-gc":
            env["PICKER_SERVER__GC_GEN0_THRESHOLD"] = "0"
        case "fair-share-off":
            env["PICKER_TENANTS__FAIR_SHARE"] = "off"
    options = StackOptions(**base, picker_args=args, picker_env=env or None)
    kind = ProxyStack if name in ("proxy", "resume") else Stack
    return kind(folder, options).start()


async def measure(row: Row, tokens: int, concurrency: int, count: int, seconds: float) -> tuple[float, int]:
    """Picker CPU seconds (less idle) and chunks for `count` streams of `tokens` tokens."""
    meter = Meter({"picker": row.pids}, idle={"picker": row.idle})
    with meter.window():
        if row.name == "tenant-header":  # a quarter of the loop per tenant, in turn
            results = []
            for tenant in TENANTS:
                part = request(tokens, row.port, tenant)
                some, _ = await closed_loop(row.port, part, concurrency, count // 4, seconds / 4)
                results += some
        else:
            results, _ = await closed_loop(row.port, request(tokens, row.port), concurrency, count, seconds)
    failed = sum(1 for r in results if not r.done)
    if failed:
        print(f"  {row.name}: {failed} of {len(results)} streams did not complete")
    done = [r for r in results if r.done]
    return meter.cpu["picker"] / max(1, len(done)), sum(r.chunks for r in done)


async def run(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    names = args.rows.split(",")
    print(f"bench_ledger: {len(names)} rows, {args.rounds} rounds, {args.concurrency} concurrent ({load()})")
    with tempfile.TemporaryDirectory(prefix="bench-ledger-") as tmp:
        workdir = Path(tmp)
        ports = [free_port(KV_OFFSET) for _ in range(3)]
        replicas = [f"127.0.0.1:{p}" for p in ports]
        extra = [*SIM_ARGS, *(arg for p in ports for arg in ("--kv-events-port", str(p + KV_OFFSET)))]
        sims = Proc("sim", sim_argv(ports, extra), workdir / "sim.log")
        try:
            for port in ports:
                sims.wait_ready(lambda p=port: health_ok(p))
            with rows(workdir, replicas, names) as measured:
                idle = await idle_rates({r.name: r.pids for r in measured}, args.idle_seconds)
                for row in measured:
                    row.idle = idle[row.name]
                per_request: dict[str, list[float]] = {r.name: [] for r in measured}
                per_chunk: dict[str, list[float]] = {r.name: [] for r in measured}
                for round_ in range(args.rounds):
                    order = measured if round_ % 2 == 0 else list(reversed(measured))
                    for row in order:
                        one, one_chunks = await measure(row, 1, args.concurrency, args.count, args.seconds)
                        many, chunks = await measure(
                            row, args.tokens, args.concurrency, args.count, args.seconds
                        )
                        per_request[row.name].append(one)
                        extra_chunks = max(1.0, chunks / args.count - one_chunks / args.count)
                        per_chunk[row.name].append((many - one) / extra_chunks)
        finally:
            sims.stop()
    return {
        name: {
            "us_per_request": statistics.median(per_request[name]) * 1e6,
            "us_per_chunk": statistics.median(per_chunk[name]) * 1e6,
        }
        for name in names
    }


def report(figures: dict[str, dict[str, float]], recorded: dict[str, Any]) -> None:
    shipped = figures.get("shipped")
    print(f"\n{'row':<11} | {'us/request':>10} | {'vs shipped':>10} | {'recorded':>8} | "
          f"{'us/chunk':>8} | {'vs shipped':>10} | {'recorded':>8}")  # fmt: skip
    for name, row in figures.items():
        was = recorded.get("rows", {}).get(name, {})

        def vs(key: str, row: dict[str, float] = row, name: str = name) -> str:
            return f"{row[key] - shipped[key]:>+10.1f}" if shipped and name != "shipped" else f"{'':>10}"

        def old(key: str, was: dict[str, float] = was) -> str:
            return f"{was[key]:>8.1f}" if key in was else f"{'-':>8}"

        request_part = f"{row['us_per_request']:>10.1f} | {vs('us_per_request')} | {old('us_per_request')}"
        chunk_part = f"{row['us_per_chunk']:>8.1f} | {vs('us_per_chunk')} | {old('us_per_chunk')}"
        print(f"{name:<11} | {request_part} | {chunk_part}")
    if recorded:
        print(f"recorded: {recorded.get('what', '')}")
    print(
        "goals (issue 56): shipped <= 650 us per one-token request at 60 concurrent; "
        "a feature that is off costs 0"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    all_rows = (
        "shipped,prefix-off,precise,latency,latency-off,rollout,tracing,plain,full-duplex,peers,proxy,resume,"
        "python-gc,fair-share-off,tenant-header"
    )
    parser.add_argument("--rows", default=all_rows)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--count", type=int, default=400, help="streams per measured loop, at most")
    parser.add_argument("--seconds", type=float, default=6.0, help="a measured loop's time, at most")
    parser.add_argument("--tokens", type=int, default=49, help="tokens of the long streams")
    parser.add_argument("--idle-seconds", type=float, default=2.0)
    parser.add_argument(
        "--record", metavar="WHAT", help="write the figures to loadtest/ledger.json, saying what"
    )
    args = parser.parse_args()
    recorded = json.loads(LEDGER.read_text()) if LEDGER.exists() else {}
    figures = asyncio.run(run(args))
    report(figures, recorded)
    print(json.dumps({"ledger": figures}))
    if args.record:
        LEDGER.write_text(json.dumps({"what": args.record, "rows": figures}, indent=1) + "\n")


if __name__ == "__main__":
    main()
