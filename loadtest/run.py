"""One runner for the benchmarks: `make bench` runs them all in order, `make bench ONLY=a,b` the ones
named, `python -m loadtest.run --list` says what exists. Each is a script in this folder that prints
its figures beside a baseline in one run (docs/benchmarks.md holds what they measured, and when).

Not in the list (each needs what most machines lack, or runs for long): bench_soak (`make bench-soak`,
~11 min), the real-vLLM ones (`make bench-realvllm`), the rollout pictures (`make rollout`,
`make rollout-real-vllm`, `make rollout-canary`) and the scale-downs (`make scale-down`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# (script, its arguments, what it measures): run in this order
BENCHES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("bench_sim", (), "streams one simulator process sustains with accurate timing"),
    ("bench_picker", (), "the picker's pick and its gRPC round trip"),
    ("bench_flow", (), "the admission queue under bursts"),
    ("bench_streams", (), "stream tracking's cost per chunk"),
    ("bench_cost", (), "the cost ledger: each feature's price per request through Envoy"),
    ("bench_ledger", (), "the ledger's rows against the recorded ones"),
    ("bench_hot_path", ("--against", "ff1d99e"), "where the request path's time goes, against a release"),
    ("bench_reference_names", (), "the reference picker's metric names' cost per request"),
    ("bench_grpc_servers", (), "grpc.aio beside a pure-Python gRPC stack"),
    ("bench_grpc_reset", (), "stream resets under load"),
    ("bench_ngf", (), "the picker behind NGINX Gateway Fabric's shape"),
    ("bench_prefix", (), "prefix keys and KV events"),
    ("bench_affinity", (), "cache-aware routing's hit rate and TTFT"),
    ("bench_ha", (), "picker failover"),
    ("bench_peers", (), "two pickers with one set of books"),
    ("bench_peer_flood", (), "a peer flooding the channel between pickers"),
    ("bench_workers", (), "--workers: requests per second per core"),
    ("bench_workers_envoy", (), "how Envoy's connections spread over workers"),
    ("bench_rollout", ("--instructions",), "a rolling update, with and without the picker"),
    ("bench_rollout_pd", (), "a prefill / decode pool's rollout: pairs, Envoy alone, a flat pool (~2 min)"),
    ("bench_pd_ttft", ("--part", "1"), "a P/D pool's TTFT against a hand-wired oracle pairing (~2 min)"),
    ("bench_pd_ttft", ("--part", "2"), "the prefill hop's worth by prompt size (~2.5 min)"),
    ("bench_shapes", (), "latency-aware routing on mixed pools"),
    ("bench_routing", (), "the routing proving ground: pool shapes x workloads (~12 min)"),
    ("bench_slo", (), "latency objectives and shedding"),
    ("bench_tenants", (), "two tenants, with and without fair share"),
    ("bench_status", (), "the status page's cost"),
    ("bench_resume_cost", ("--token-ids",), "resume's cost per stream"),
    ("bench_proxy", (), "picker proxy beside vllm-router (with .venv-router)"),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help="comma-separated script names (default: all)")
    parser.add_argument("--list", action="store_true", help="say what exists and stop")
    args = parser.parse_args(argv)
    if args.list:
        width = max(len(name) for name, _, _ in BENCHES)
        for name, extra, what in BENCHES:
            print(f"{name:<{width}}  {what}" + (f" ({' '.join(extra)})" if extra else ""))
        return 0
    wanted = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {name for name, _, _ in BENCHES})
    if unknown:
        parser.error(f"no such benchmark: {', '.join(unknown)} (--list says what exists)")
    chosen = [b for b in BENCHES if not wanted or b[0] in wanted]
    router = HERE.parent / ".venv-router" / "bin" / "vllm-router"
    env = {**os.environ, **({"VLLM_ROUTER": str(router)} if router.exists() else {})}
    failed = []
    for name, extra, what in chosen:
        print(f"\n=== {name}: {what}", flush=True)
        started = time.monotonic()
        code = subprocess.call([sys.executable, "-m", f"loadtest.{name}", *extra], cwd=HERE.parent, env=env)
        print(f"=== {name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print("failed: " + ", ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
