"""Benchmark: load spread over the replicas with one picker vs two or four active-active pickers.

Several pickers behind one Envoy (the `picker` cluster with every picker as a host, ext_proc streams
spread round robin) each count only their own in-flight requests; the engines' scraped running counts are the
shared truth. Same traffic for each variant (a closed loop of streams through the real Envoy), and
every replica's running count (GET /sim/state) sampled while it runs: the spread is max/mean running
per replica over the samples (1.0 = perfectly even).

Variants: `one` (one picker), `two` and `four` (that many pickers, engine scrape on: the default),
`two-noscrape` (two pickers, in-flight only: what each picker alone can know).
`elsewhere`: observer streams a picker got for requests another picker routed (Envoy picks a host for
each ext_proc stream on its own). Run: `python -m loadtest.bench_ha [--streams 24] [--seconds 15]
[--replicas 4]` (about 1.5 min).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

import loadtest.stack as stack_module
from loadtest.procs import Proc, free_port
from loadtest.stack import Stack, StackOptions, parse_metrics, serve_argv
from loadtest.traffic import run_closed_loop

VARIANTS = {"one": 1, "two": 2, "two-noscrape": 2, "four": 4}  # variant: pickers


def with_more_pickers(ports: Sequence[int]) -> None:
    """Make the stack's Envoy config list more hosts in the `picker` cluster."""
    original = stack_module.render

    def render_more(params: Any, template: Path | None = None) -> str:
        text = original(params) if template is None else original(params, template)
        config = yaml.safe_load(text)
        for cluster in config["static_resources"]["clusters"]:
            if cluster["name"] == "picker":
                endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                endpoints.extend(
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                        }
                    }
                    for port in ports
                )
        return yaml.safe_dump(config, sort_keys=False)

    stack_module.render = render_more  # type: ignore[assignment]


def another_picker(workdir: Path, name: str, grpc_port: int, metrics_port: int, extra: Sequence[str]) -> Proc:
    argv = serve_argv(grpc_port, free_port(), metrics_port, "--quiet-interval", "0.2", *extra)
    proc = Proc(name, argv, workdir / f"{name}.log")
    proc.wait_ready(lambda: "picker ready" in proc.log_text())
    return proc


def counters(metrics_port: int) -> tuple[float, float]:
    """(picks, observer streams for requests another picker routed) of one picker."""
    metrics = parse_metrics(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text)
    picks = sum(v for (name, _), v in metrics.items() if name == "picker_picks_total")
    return picks, metrics.get(("picker_observer_unmatched_total", ()), 0.0)


class Sampler:
    """Every replica's running count, every `interval_s`, on a thread (the load loop owns the loop)."""

    def __init__(self, replicas: list[str], interval_s: float = 0.1) -> None:
        self.replicas = replicas
        self.interval_s = interval_s
        self.samples: list[list[int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.wait(self.interval_s):
                try:
                    row = [int(client.get(f"http://{r}/sim/state").json()["running"]) for r in self.replicas]
                except (httpx.HTTPError, KeyError, ValueError):
                    continue
                self.samples.append(row)

    def spread(self) -> tuple[float, float, float]:
        """(mean, p95, max) over samples of max/mean running per replica (samples with any load)."""
        ratios = [max(row) / statistics.fmean(row) for row in self.samples if sum(row) > 0]
        if not ratios:
            return float("nan"), float("nan"), float("nan")
        ratios.sort()
        return statistics.fmean(ratios), ratios[int(0.95 * (len(ratios) - 1))], ratios[-1]


async def one_variant(variant: str, args: argparse.Namespace, root: Path) -> str:
    workdir = root / variant
    workdir.mkdir()
    endpoints_file = workdir / "endpoints.yaml"
    scrape = () if variant != "two-noscrape" else ("--no-scrape",)
    source = ("--endpoints-file", str(endpoints_file), *scrape)
    options = StackOptions(
        replicas=args.replicas,
        static_endpoints=False,
        picker_args=source,
        sim_args=("--ttft-ms", "20", "--itl-ms", "25", "--max-num-seqs", str(args.slots)),
    )
    stack = Stack(workdir, options)
    endpoints_file.write_text("".join(f"- {r}\n" for r in stack.replicas))
    render = stack_module.render
    others: list[tuple[Proc, int]] = []  # the pickers beside the stack's own, with their metrics ports
    try:
        stack.start_sims()
        stack.start_picker()
        ports = []
        for index in range(2, VARIANTS[variant] + 1):
            port, metrics_port = free_port(), free_port()
            others.append(
                (another_picker(workdir, f"picker-{index}", port, metrics_port, source), metrics_port)
            )
            ports.append(port)
        if ports:
            with_more_pickers(ports)
        stack.start_envoy()
        with Sampler(stack.replicas) as sampler:
            report = await run_closed_loop(
                stack.url,
                concurrency=args.streams,
                max_requests=args.streams * 1000,
                deadline_s=args.seconds,
                max_tokens=args.tokens,
            )
        failed = sum(1 for r in report.results if not r.ok)
        (first_picks, unmatched), *rest = [counters(stack.metrics_port)] + [counters(m) for _, m in others]
        other_picks = sum(p for p, _ in rest)
        unmatched += sum(u for _, u in rest)
        share = other_picks / max(1.0, first_picks + other_picks)
        elsewhere = unmatched / max(1.0, first_picks + other_picks)
        mean, p95, worst = sampler.spread()
        return (
            f"{variant:<13} | {len(report.results):>8} | {failed:>6} | {len(sampler.samples):>7} | "
            f"{mean:>9.2f} | {p95:>8.2f} | {worst:>8.2f} | {share:>6.0%} | {elsewhere:>8.0%}"
        )
    finally:
        stack_module.render = render  # type: ignore[assignment]
        for proc, _ in others:
            proc.stop()
        stack.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=24, help="concurrent streams (closed loop)")
    parser.add_argument("--seconds", type=float, default=15.0, help="load per variant")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per stream (25 ms apart)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=256, help="each replica's --max-num-seqs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    print(f"{args.streams} streams x {args.tokens} tokens, {args.replicas} replicas, {args.seconds:g} s each")
    print(
        "variant       | requests | failed | samples | max/mean  | p95      | worst    | others | elsewhere"
    )
    with tempfile.TemporaryDirectory(prefix="bench-ha-") as root:
        for variant in variants:
            started = time.monotonic()
            line = await one_variant(variant, args, Path(root))
            print(f"{line}   ({time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
