"""Benchmark: how the picker should see response bodies (the design choice of stream tracking).

Four Envoy configurations over the same simulated replicas, in one run:
  baseline  Envoy alone, round robin (no picker on the path)
  observer  routing filter with response bodies off (NONE) + an observability-mode filter that sees
            every chunk without holding it (the picker's default)
  streamed  routing filter with response_body_mode STREAMED: every chunk waits for the picker
  duplex    routing filter with request and response bodies FULL_DUPLEX_STREAMED, no observer (Envoy
            AI Gateway's default shape): the picker echoes every response chunk back to Envoy
For each: N concurrent streams at 20 tokens/s. Per-chunk latency added is read as each chunk's
lateness against its stream's schedule (arrival - first chunk - i x ITL) p50/p99, next to TTFT p50/p99;
then the picker's CPU per chunk; then what a picker SIGKILL does to streams in flight.
A raw asyncio client (no HTTP library) keeps the client's own cost out of the figures.
Run: `python -m loadtest.bench_streams [--streams 200] [--modes observer,duplex]` (about 2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
from pathlib import Path

import yaml

from loadtest.procs import wait_until
from loadtest.rawclient import ITL_S, cpu_seconds, one_stream
from loadtest.stack import Stack, StackOptions


def pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def envoy_variant(stack: Stack, mode: str) -> None:
    """Rewrite the stack's Envoy config for one of the three modes before Envoy starts."""
    import loadtest.stack as stack_module
    from picker.cli.envoyconf import render

    def render_variant(params: object, template: Path | None = None) -> str:
        config = yaml.safe_load(render(params) if template is None else render(params, template))  # type: ignore[arg-type]
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = hcm["http_filters"]
        if mode == "baseline":
            hcm["http_filters"] = [
                f for f in filters if not f["name"].startswith("envoy.filters.http.ext_proc")
            ]
        elif mode in ("streamed", "duplex"):
            hcm["http_filters"] = [f for f in filters if f["name"] != "envoy.filters.http.ext_proc.observer"]
            processing = hcm["http_filters"][0]["typed_config"]["processing_mode"]
            if mode == "streamed":
                processing["response_body_mode"] = "STREAMED"
            else:  # Envoy requires trailers SEND with FULL_DUPLEX_STREAMED bodies
                processing.update(
                    request_body_mode="FULL_DUPLEX_STREAMED",
                    request_trailer_mode="SEND",
                    response_body_mode="FULL_DUPLEX_STREAMED",
                    response_trailer_mode="SEND",
                )
        return yaml.safe_dump(config)

    stack_module.render = render_variant  # type: ignore[assignment]


async def measure(mode: str, streams: int, tokens: int, workdir: Path) -> None:
    options = StackOptions(
        replicas=3, sim_args=("--ttft-ms", "20", "--itl-ms", str(ITL_S * 1000)), picker_args=("--no-scrape",)
    )
    stack = Stack(workdir / mode, options)
    (workdir / mode).mkdir()
    envoy_variant(stack, mode)
    await asyncio.to_thread(stack.start)
    try:
        assert stack.picker is not None
        cpu_before = cpu_seconds(stack.picker.pid)
        ramp = 1.0 / streams
        tasks = []
        for _ in range(streams):
            tasks.append(asyncio.create_task(one_stream(stack.listen_port, tokens)))
            await asyncio.sleep(ramp)  # spread stream phases over one second
        results = await asyncio.gather(*tasks)
        cpu = cpu_seconds(stack.picker.pid) - cpu_before
        lateness = []
        ttfts = []
        chunks = 0
        for r in results:
            if r.arrivals:
                ttfts.append(r.arrivals[0] - r.started)
                first = r.arrivals[0]
                lateness.extend((t - first - i * ITL_S) * 1e3 for i, t in enumerate(r.arrivals))
                chunks += len(r.arrivals)
        failed = sum(1 for r in results if not r.done)
        per_chunk = cpu / chunks * 1e6 if chunks and mode != "baseline" else float("nan")
        late = f"{pct(lateness, 50):>8.2f} | {pct(lateness, 99):>8.2f}"
        ttft = f"{pct(ttfts, 50) * 1e3:>8.1f} | {pct(ttfts, 99) * 1e3:>8.1f}"
        print(f"{mode:<9} | {streams:>7} | {chunks:>6} | {late} | {ttft} | {per_chunk:>11.0f} | {failed:>6}")
        if mode != "baseline":
            await kill_during_streams(stack, mode)
    finally:
        stack.stop()


async def kill_during_streams(stack: Stack, mode: str, count: int = 20) -> None:
    assert stack.picker is not None
    stack.picker.kill()
    stack.start_picker()  # fresh picker, then kill it while streams run
    tasks = [asyncio.create_task(one_stream(stack.listen_port, 40)) for _ in range(count)]
    await asyncio.to_thread(wait_until, lambda: stack.picker_value("picker_in_flight") >= count, 10)
    stack.picker.kill()
    results = await asyncio.gather(*tasks)
    cut = sum(1 for r in results if not r.done)
    KILLS[mode] = f"{cut}/{count} streams cut by a picker SIGKILL (fail-closed)"


KILLS: dict[str, str] = {}
MODES = ("baseline", "observer", "streamed", "duplex")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes: {', '.join(unknown)}")
    print(
        f"{args.streams} concurrent streams x {args.tokens} tokens at {1 / ITL_S:.0f} tokens/s, 3 replicas\n"
    )
    print(
        f"{'mode':<9} | {'streams':>7} | {'chunks':>6} | {'late p50':>8} | {'late p99':>8} | "
        f"{'TTFT p50':>8} | {'TTFT p99':>8} | {'picker us/chunk':>11} | {'failed':>6}"
    )
    units = " | ".join(f"{'(ms)':>8}" for _ in range(4))
    print(f"{'':<9} | {'':>7} | {'':>6} | {units} | {'(CPU)':>11} |")
    with tempfile.TemporaryDirectory(prefix="bench-streams-") as tmp:
        for mode in modes:
            await measure(mode, args.streams, args.tokens, Path(tmp))
    print()
    for mode, text in KILLS.items():
        print(f"{mode}: {text}")


if __name__ == "__main__":
    import uvloop

    uvloop.run(main())
