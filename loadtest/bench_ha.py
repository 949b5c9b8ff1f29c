"""Benchmark: load spread and books with one picker vs two or four active-active pickers.

Several pickers behind one Envoy (the `picker` cluster lists every picker, ext_proc streams spread
round robin, so a request's observer stream lands on another picker than the one that routed it about
half the time). Same traffic for each variant (a closed loop of streams through the real Envoy), and
every replica's running count (GET /sim/state) sampled while it runs: the spread is max/mean running
per replica over the samples (1.0 = perfectly even). `exact` / its `p95`: the same ratio weighted by
time, from the replicas' own request logs (arrival and end of every request) while the loop sends,
after its first wave: the sampler's GETs, one replica after another, skew under load. `misplaced`:
the share of that time some replica ran more than the best placement would give it: what the pickers
got wrong, apart from the closed loop's gaps between one stream's end and the next request (which
max/mean counts too). Every stream has `--tokens` tokens by default, so ends come in waves;
`--tokens-spread N` draws each length within N of it.

Variants: `one` (one picker), `two-separate` (two pickers, each with its own books: the shape before
issue 23), `two` and `four` (that many pickers sharing one set of books over the channel between
pickers, `--peers`); to tell causes apart, `two-noscrape` / `four-noscrape` (no engine gauges) and
`four-scrape1s` (gauges every second). Columns: `elsewhere`: observer streams a picker got for a
request another picker routed (handed to the routing picker with peers, unmatched without);
`early`: of the ends each picker booked for a request it did not observe, the share a newer request
on the same client connection told it first (picker/pool/connections.py); `timer`: requests ended
by the observer grace timer or as unobserved while they still streamed (0 is the goal); `routed`:
each picker's share of the routing streams (what its flow-control queue sees).
Run (about 1.5 min):
`python -m loadtest.bench_ha [--streams 24] [--seconds 15] [--replicas 4] [--tokens-spread 0]`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from loadtest import http_client
from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import run_closed_loop

VARIANTS = {  # variant: (pickers, shared books, extra picker args)
    "one": (1, False, ()),
    "two-separate": (2, False, ()),
    "two": (2, True, ()),
    "four": (4, True, ()),
    "two-noscrape": (2, True, ("--no-scrape",)),
    "four-noscrape": (4, True, ("--no-scrape",)),
    "four-scrape1s": (4, True, ("--scrape-interval", "1")),
}


def counters(metrics_port: int) -> dict[str, float]:
    """One picker's picks, foreign observer streams and ends other than by the response."""
    metrics = parse_metrics(http_client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text)

    def total(name: str, **labels: str) -> float:
        want = set(labels.items())
        return sum(v for (n, ls), v in metrics.items() if n == name and want <= set(ls))

    return {
        "picks": total("picker_picks_total"),
        "unmatched": total("picker_observer_unmatched_total"),
        "foreign": total("picker_peer_observers_total"),
        "superseded": total("picker_peer_superseded_total"),
        "timer": total("picker_request_ends_total", reason="unobserved")
        + total("picker_request_ends_total", reason="client-disconnect"),
    }


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
        with http_client.Client(timeout=2) as client:
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


def exact_spread(
    logs: list[list[dict[str, object]]], since: float, until: float
) -> tuple[float, float, float]:
    """(time-weighted mean, p95) of max/mean running per replica from the replicas' own request logs
    (arrival and end of each request, one clock): no snapshot skew between replicas, unlike the
    sampler's one GET after another. Only while the loop was sending (`since` to `until`), and only
    instants with any load. Third: the share of that time a replica ran more than the best placement
    of what was running would give it (more than ceil(running / replicas)): the pickers' own
    misplacements, apart from the closed loop's gaps between a stream's end and the next request's
    arrival, which max/mean also counts (23 streams over 4 replicas read 6 / 5.75 = 1.04)."""
    events: list[tuple[float, int, int]] = []
    for index, log in enumerate(logs):
        for entry in log:
            arrival, end = entry.get("arrival"), entry.get("end")
            if isinstance(arrival, float):
                events.append((arrival, index, 1))
                events.append((end if isinstance(end, float) else until, index, -1))
    events.sort()
    running = [0] * len(logs)
    weighted: list[tuple[float, float]] = []  # (ratio, seconds)
    misplaced = 0.0
    previous = since
    for at, index, delta in events:
        start, stop = max(previous, since), min(at, until)
        if stop > start and sum(running) > 0:
            weighted.append((max(running) / statistics.fmean(running), stop - start))
            if max(running) > -(-sum(running) // len(running)):
                misplaced += stop - start
        previous = max(previous, at)
        running[index] += delta
    total = sum(seconds for _, seconds in weighted)
    if total <= 0:
        return float("nan"), float("nan"), float("nan")
    mean = sum(ratio * seconds for ratio, seconds in weighted) / total
    weighted.sort()
    covered, p95 = 0.0, weighted[-1][0]
    for ratio, seconds in weighted:
        covered += seconds
        if covered >= 0.95 * total:
            p95 = ratio
            break
    return mean, p95, misplaced / total


async def one_variant(variant: str, args: argparse.Namespace, root: Path) -> str:
    workdir = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=root))
    pickers, peers, extra = VARIANTS[variant]
    options = StackOptions(
        replicas=args.replicas,
        pickers=pickers,
        peers=peers,
        envoy_picker_tls=False,
        picker_args=extra,
        sim_args=("--ttft-ms", "20", "--itl-ms", "25", "--max-num-seqs", str(args.slots)),
    )
    stack = Stack(workdir, options)
    try:
        stack.start()
        since = time.time()
        with Sampler(stack.replicas) as sampler:
            report = await run_closed_loop(
                stack.url,
                concurrency=args.streams,
                max_requests=args.streams * 1000,
                deadline_s=args.seconds,
                max_tokens=args.tokens,
                tokens_spread=args.tokens_spread,
            )
        failed = sum(1 for r in report.results if not r.ok)
        await asyncio.to_thread(stack.wait_no_leaks)
        rows = [counters(metrics) for _, _, metrics in stack.picker_ports]
        picks = max(1.0, sum(r["picks"] for r in rows))
        elsewhere = sum(r["unmatched"] + r["foreign"] for r in rows) / picks
        # each picker books every end; all but the observer's picker hear it from another
        early = sum(r["superseded"] for r in rows) / max(1.0, picks * (len(rows) - 1))
        timer = sum(r["timer"] for r in rows)
        shares = "/".join(f"{r['picks'] / picks:.0%}" for r in rows)  # each picker's share of the routing
        mean, p95, worst = sampler.spread()
        logs = [stack.sim_requests(replica) for replica in stack.replicas]
        # from 1 s in: past the first wave
        exact, exact_p95, misplaced = exact_spread(logs, since + 1.0, since + args.seconds)
        return (
            f"{variant:<13} | {len(report.results):>8} | {failed:>6} | {len(sampler.samples):>7} | "
            f"{mean:>8.2f} | {p95:>6.2f} | {worst:>6.2f} | {exact:>5.2f} | {exact_p95:>5.2f} | "
            f"{misplaced:>9.1%} | {elsewhere:>9.0%} | {early:>5.0%} | {timer:>5.0f} | {shares}"
        )
    finally:
        stack.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--streams", type=int, default=24, help="concurrent streams (closed loop)")
    parser.add_argument("--seconds", type=float, default=15.0, help="load per variant")
    parser.add_argument("--tokens", type=int, default=40, help="tokens per stream (25 ms apart)")
    parser.add_argument(
        "--tokens-spread",
        type=int,
        default=0,
        help="each stream's length drawn within this many tokens of --tokens (0: all alike: ends in waves)",
    )
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--slots", type=int, default=256, help="each replica's --max-num-seqs")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    lengths = f"{args.tokens} +- {args.tokens_spread}" if args.tokens_spread else str(args.tokens)
    print(f"{args.streams} streams x {lengths} tokens, {args.replicas} replicas, {args.seconds:g} s each")
    columns = (
        *("variant      ", "requests", "failed", "samples", "max/mean", "p95   ", "worst "),
        *("exact", "p95  ", "misplaced", "elsewhere", "early"),
    )
    print(" | ".join((*columns, "timer", "routed")))
    with tempfile.TemporaryDirectory(prefix="bench-ha-") as root:
        for variant in variants:
            started = time.monotonic()
            line = await one_variant(variant, args, Path(root))
            print(f"{line}   ({time.monotonic() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
