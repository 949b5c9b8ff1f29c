"""Benchmark: how Envoy spreads its ext_proc streams over a `picker serve --workers 2` pod.

SO_REUSEPORT hands each new TCP connection to one worker for its whole life, so a pod's workers
share the load only as far as Envoy's connections to the picker cluster do. Envoy's gRPC client
(envoy_grpc) holds one HTTP/2 connection per Envoy worker thread to a cluster host and puts every
stream on it, so an Envoy with --concurrency 1 feeds one picker worker, and with --concurrency 2 both
only when the kernel's hash puts the two connections on different workers. The cluster's own
`http2_protocol_options.max_concurrent_streams` caps the streams per connection: Envoy's pool then
opens another connection once a connection is full, and the hash spreads those. Or
`common_http_protocol_options.max_requests_per_connection` retires a connection after so many
streams: its successor is hashed anew, so over time the streams spread (a handshake each time).

Configs, each a fresh stack (3 simulated replicas, the shipped Envoy config in plaintext, the pod):
Envoy --concurrency 1 and 2 as shipped, and --concurrency 2 with the picker cluster capped at
--cap streams a connection, or retiring each connection after --recycle streams. Per config: the
pod's connections per worker (sampled mid-load, EDS's included) and each worker's share of the
picks, under --concurrency closed-loop streaming clients.
Bounded: --requests each, about 1 minute in all. Run: `python -m loadtest.bench_workers_envoy`.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

from loadtest.bench_workers import books, connections_of, worker_pids
from loadtest.procs import Proc, free_port, port_open, wait_until
from loadtest.stack import Stack, StackOptions, health_ok
from loadtest.traffic import run_closed_loop
from picker.cli.envoyconf import envoy_binary, render, shape_template

SHIPPED_HTTP2 = "explicit_http_config: {http2_protocol_options: {}}"


class CappedStack(Stack):
    """The shipped Envoy config, the picker cluster's streams per connection capped (0: as shipped)."""

    def __init__(self, workdir: Path, options: StackOptions, cap: int, recycle: int = 0) -> None:
        super().__init__(workdir, options)
        self.cap, self.recycle = cap, recycle

    def start_envoy(self) -> None:
        text = render(self.envoy_params(), shape_template(self.options.shape))
        assert text.count(SHIPPED_HTTP2) == 1  # the picker cluster's (the pool's is HTTP/1)
        if self.recycle:
            common = f"common_http_protocol_options: {{max_requests_per_connection: {self.recycle}}}"
            text = text.replace(SHIPPED_HTTP2, f"{common}\n        {SHIPPED_HTTP2}")
        if self.cap:
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


async def one(envoy_concurrency: int, cap: int, recycle: int, args: argparse.Namespace, workdir: Path) -> str:
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
    stack = CappedStack(workdir, options, cap, recycle).start()
    try:
        picker = stack.picker
        assert picker is not None
        wait_until(lambda: picker.log_text().count("picker ready") == 2, 30, what="both workers")
        pids = worker_pids(picker, 2)
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
    shape = f"{cap} streams a connection" if cap else f"a connection per {recycle} streams" if recycle else ""
    name = f"envoy --concurrency {envoy_concurrency}, {shape or 'as shipped'}"
    return f"{name:<52} connections {connections[0]}/{connections[1]}   picks {shares}   failed {failed}"


async def run(args: argparse.Namespace) -> None:
    lines = []
    with tempfile.TemporaryDirectory(prefix="bench-workers-envoy-") as tmp:
        configs = ((1, 0, 0), (2, 0, 0), (2, args.cap, 0), (2, 0, args.recycle))
        for index, (concurrency, cap, recycle) in enumerate(configs):
            workdir = Path(tmp) / str(index)
            line = await one(concurrency, cap, recycle, args, workdir)
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
    parser.add_argument(
        "--recycle", type=int, default=50, help="streams a connection carries, then a new one"
    )
    parser.add_argument("--sample-after", type=float, default=2.0, help="seconds into the load")
    args = parser.parse_args()
    if not 1 <= args.requests <= 2000:
        parser.error("--requests 1-2000 keeps a run bounded")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
