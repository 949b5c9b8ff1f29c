"""Benchmark: how Envoy spreads its ext_proc streams over a `picker serve --workers 2` pod.

SO_REUSEPORT hands each new TCP connection to one worker for its whole life, so a pod's workers
share the load only as far as Envoy's connections to the picker cluster do. Envoy's gRPC client
(envoy_grpc) holds one HTTP/2 connection per Envoy worker thread to a cluster host and puts every
stream on it, so an Envoy with --concurrency 1 feeds one picker worker, and with --concurrency 2 both
only when the kernel's hash puts the two connections on different workers. The cluster's own
`http2_protocol_options.max_concurrent_streams` caps the streams per connection: Envoy's pool then
opens another connection once a connection is full, and the hash spreads those.

Configs, each a fresh stack (3 simulated replicas, the shipped Envoy config in plaintext, the pod):
Envoy --concurrency 1 and 2 as shipped, and --concurrency 2 with the picker cluster capped at
--cap streams a connection. Per config: the pod's connections per worker (sampled mid-load, EDS's
included) and each worker's share of the picks, under --concurrency closed-loop streaming clients.
Bounded: --requests each, about 1 minute in all. Run: `python -m loadtest.bench_workers_envoy`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from loadtest.bench_workers import books, connections_of, worker_pids
from loadtest.procs import Proc, free_port, port_open
from loadtest.stack import Stack, StackOptions, health_ok
from loadtest.traffic import run_closed_loop
from picker.cli.envoyconf import envoy_binary, render, shape_template

SHIPPED_HTTP2 = "explicit_http_config: {http2_protocol_options: {}}"


class CappedStack(Stack):
    """The shipped Envoy config, the picker cluster's streams per connection capped (0: as shipped)."""

    def __init__(self, workdir: Path, options: StackOptions, cap: int) -> None:
        super().__init__(workdir, options)
        self.cap = cap

    def start_envoy(self) -> None:
        text = render(self.envoy_params(), shape_template(self.options.shape))
        if self.cap:
            assert text.count(SHIPPED_HTTP2) == 1  # the picker cluster's (the pool's is HTTP/1)
            capped = (
                f"explicit_http_config: {{http2_protocol_options: {{max_concurrent_streams: {self.cap}}}}}"
            )
            text = text.replace(SHIPPED_HTTP2, capped)
        config = self.workdir / "envoy.yaml"
        config.write_text(text)
        argv = [envoy_binary(), "-c", str(config), "--use-dynamic-base-id", "--log-level", "warn"]
        argv += ["--concurrency", str(self.options.envoy_concurrency)]
        self.envoy = Proc("envoy", argv, self.workdir / "envoy.log")
        self.envoy.wait_ready(
            lambda: health_ok(self.admin_port, "/ready") and port_open(self.listen_port), timeout=30
        )


async def one(envoy_concurrency: int, cap: int, args: argparse.Namespace, workdir: Path) -> str:
    metrics, peers = free_port(paired=1), free_port(paired=1)
    pod = (
        "--workers",
        "2",
        "--peer-port",
        str(peers),
        "--metrics-port",
        str(metrics),
        "--log-level",
        "WARNING",
    )
    options = StackOptions(envoy_picker_tls=False, envoy_concurrency=envoy_concurrency, picker_args=pod)
    stack = CappedStack(workdir, options, cap).start()
    try:
        assert stack.picker is not None
        pids = worker_pids(stack.picker, 2)
        ports = [metrics, metrics + 1]
        before = [picks for _, _, picks in books(ports)]
        load = asyncio.create_task(
            run_closed_loop(
                stack.url, concurrency=args.concurrency, max_requests=args.requests, deadline_s=60
            )
        )
        await asyncio.sleep(args.sample_after)  # a measurement point mid-load, not a synchronisation
        connections = connections_of(pids, stack.grpc_port)
        report = await load
        picks = [after - b for (_, _, after), b in zip(books(ports), before, strict=True)]
        failed = len(report.failures())
    finally:
        stack.stop()
    total = max(sum(picks), 1)
    shares = "/".join(f"{p / total:.0%}" for p in picks)
    name = f"envoy --concurrency {envoy_concurrency}, " + (
        f"{cap} streams a connection" if cap else "as shipped"
    )
    return f"{name:<48} connections {connections[0]}/{connections[1]}   picks {shares}   failed {failed}"


async def run(args: argparse.Namespace) -> None:
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-envoy-") as tmp:
        for index, (concurrency, cap) in enumerate(((1, 0), (2, 0), (2, args.cap))):
            workdir = Path(tmp) / str(index)
            line = await one(concurrency, cap, args, workdir)
            print(" ", line, flush=True)
            lines.append(line)
    print("\nconnections and picks per worker (worker 0 / worker 1):")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=300, help="per config")
    parser.add_argument("--concurrency", type=int, default=24, help="closed-loop streaming clients")
    parser.add_argument("--cap", type=int, default=4, help="streams a connection in the capped config")
    parser.add_argument("--sample-after", type=float, default=2.0, help="seconds into the load")
    args = parser.parse_args()
    if not 1 <= args.requests <= 2000:
        parser.error("--requests 1-2000 keeps a run bounded")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
