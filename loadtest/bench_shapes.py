"""Benchmark: the picker in every ext_proc shape it claims, on a mixed pool near its capacity, against
Envoy alone with least request, side by side in one run.

The pool (issue 45): four simulated replicas, two fast with 16 slots, one half as fast with 16 slots,
one fast with 8 slots. Poisson arrivals of streaming completions with prompts of 50-2,000 words and
20-100 tokens (seeded: every row sends the same requests at the same moments). Per row: TTFT p50 and
p90, the time per output token p90, both against the better Envoy-alone row above it, requests
failed, each replica's share of the requests (its own counter), and how far the picker's books (the
occupancy flow control judges from, per replica) were from the engines' own running + waiting
gauges, sampled together over the run.

Rows: Envoy alone (least request, or round robin; no picker); the shipped config (routing + observer
filters); the lean shape (Envoy's gRPC access log ends requests); the routing filter with STREAMED
response bodies; Envoy Gateway's buffered shape (response headers only: the picker sees no end); the
same with Envoy's gRPC access log added; Envoy AI Gateway's FULL_DUPLEX_STREAMED (override_host) and
ORIGINAL_DST shapes; kgateway (response headers SKIP); NGINX Gateway Fabric's shim client (a gRPC
connection per request, no response phase), which then sends each request straight to the replica it
was given.

Bounded: each row sends `rate * seconds` requests and stops at its deadline.

    python -m loadtest.bench_shapes [--rate 55] [--seconds 15] [--rows eg-buffered,ngf-shim,...]

A picker row may name a variant, `row@on` (affinity.latency on), `row@off`, and with `--baseline PATH`
`row@main` / `row@main-on` (the picker found at PATH, e.g. an export of main; run from a directory
without a `picker` package).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from loadtest.ngf_client import ShimClient
from loadtest.procs import Proc, free_port, port_open
from loadtest.rawclient import StreamStats, one_stream
from loadtest.stack import Stack, StackOptions, health_ok, parse_metrics
from loadtest.traffic import percentile
from picker.cli.envoyconf import envoy_binary, render, shape_template

FAST_TTFT_MS = 20.0  # a fast replica's first token: this, plus its prefill of each prompt token
FAST_PREFILL_MS = 0.02


def pool(itl_ms: float = 12.0) -> tuple[tuple[str, ...], ...]:
    """The mixed pool's simulator arguments: fast replicas `itl_ms` a token, the slow one twice that."""
    fast = ("--ttft-ms", f"{FAST_TTFT_MS:g}", "--itl-ms", f"{itl_ms:g}")
    fast += ("--ttft-per-prompt-token-ms", f"{FAST_PREFILL_MS:g}")
    slow = ("--ttft-ms", f"{2 * FAST_TTFT_MS:g}", "--itl-ms", f"{2 * itl_ms:g}")
    slow += ("--ttft-per-prompt-token-ms", f"{2 * FAST_PREFILL_MS:g}")
    return (
        (*fast, "--max-num-seqs", "16"),
        (*fast, "--max-num-seqs", "16"),
        (*slow, "--max-num-seqs", "16"),
        (*fast, "--max-num-seqs", "8"),
    )


POOL = pool()
SIM_COMMON = ("--max-model-len", "16384", "--no-enable-prefix-caching")
WORDS = ("alpha", "bravo", "delta", "gamma", "kilo", "lima", "oscar", "tango", "victor", "zulu")


@dataclass(frozen=True)
class Row:
    name: str
    shape: str = "shipped"
    observer: bool = True
    routing_response_body: str = "NONE"
    picker_access_log: bool = False
    picker: bool = True  # False: Envoy alone, least request (or `lb_policy`)
    lb_policy: str = "LEAST_REQUEST"  # Envoy alone: its pool cluster's balancer
    shim: bool = False  # NGINX Gateway Fabric's shim client instead of Envoy


ROWS: dict[str, Row] = {
    row.name: row
    for row in (
        Row("envoy-least-request", shape="eg-buffered", picker=False),
        Row("envoy-round-robin", shape="eg-buffered", picker=False, lb_policy="ROUND_ROBIN"),
        Row("shipped-observer"),
        Row("lean-access-log", observer=False),
        Row("streamed", observer=False, routing_response_body="STREAMED"),
        Row("eg-buffered", shape="eg-buffered"),
        Row("eg-buffered+access-log", shape="eg-buffered", picker_access_log=True),
        Row("aigw-full-duplex", shape="aigw-failopen"),
        Row("aigw-original-dst", shape="aigw-failclose"),
        Row("kgateway", shape="kgateway"),
        Row("ngf-shim", picker=True, shim=True),
    )
}


# a picker row's variant (row@variant): the picker's environment
VARIANTS: dict[str, dict[str, str]] = {
    "": {},
    "off": {"PICKER_AFFINITY__LATENCY": "off"},
    "on": {"PICKER_AFFINITY__LATENCY": "on"},
    "main": {"PYTHONPATH": "BASELINE"},
    "main-on": {"PYTHONPATH": "BASELINE", "PICKER_AFFINITY__LATENCY": "true"},
}


@dataclass
class Outcome:
    stats: list[StreamStats] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)  # |books - engine| per replica per sample
    modes: str = ""
    at_scrapes: dict[float, float] = field(default_factory=dict)  # the picker's histogram, le -> count
    served: list[float] = field(default_factory=list)  # requests each replica completed (its counter)
    queued_ms: list[float] = field(default_factory=list)  # each replica's mean wait for a batch slot
    latency: str = ""  # affinity.latency at the end: engaged or not, and the spread auto judged by


def plan(rate: float, seconds: float, seed: int) -> list[tuple[float, str, int]]:
    """(offset, prompt, max_tokens) of every request: Poisson arrivals, seeded."""
    rng = random.Random(seed)
    out: list[tuple[float, str, int]] = []
    at = 0.0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            return out
        words = rng.randint(50, 2000)
        prompt = " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(words))
        out.append((at, prompt, rng.randint(20, 100)))


def prompt_tokens(prompt: str) -> int:
    """The simulator's count: one token per 4 characters (sim/vllm_sim/prefix.py)."""
    return max(1, math.ceil(len(prompt) / 4))


def own_first_token_ms(requests: Sequence[tuple[float, str, int]]) -> tuple[float, float]:
    """The requests' own first token on an idle fast replica of `pool` (its fixed part and its
    prompt's prefill, the simulator's tokens being a quarter of the characters): p50 and p90 ms,
    what no routing goes below, before the path's own time."""
    own = sorted(FAST_TTFT_MS + FAST_PREFILL_MS * prompt_tokens(prompt) for _, prompt, _ in requests)
    return percentile(own, 50), percentile(own, 90)


async def engine_load(client: httpx.AsyncClient, replica: str) -> float:
    samples = parse_metrics((await client.get(f"http://{replica}/metrics")).text)
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    return sum(v for (n, _), v in samples.items() if n in names)


async def books(client: httpx.AsyncClient, metrics_port: int) -> dict[str, float]:
    """The picker's occupancy per replica (what flow control judges from)."""
    listed = (await client.get(f"http://127.0.0.1:{metrics_port}/admin/endpoints")).json()
    return {e["address"]: float(e.get("occupancy", e["in_flight"])) for e in listed["endpoints"]}


async def sample(replicas: Sequence[str], metrics_port: int | None, until: float, gaps: list[float]) -> None:
    """Every 200 ms until `until`: the picker's books and the engines' gauges, read together."""
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.perf_counter() < until:
            started = time.perf_counter()
            try:
                engines = await asyncio.gather(*(engine_load(client, r) for r in replicas))
                if metrics_port is not None:
                    mine = await books(client, metrics_port)
                    gaps.extend(abs(mine.get(r, 0.0) - e) for r, e in zip(replicas, engines, strict=True))
            except httpx.HTTPError:
                pass
            await asyncio.sleep(max(0.0, 0.2 - (time.perf_counter() - started)))


Send = Callable[[str, int], Awaitable[StreamStats]]


async def drive(send: Send, requests: list[tuple[float, str, int]]) -> list[StreamStats]:
    started = time.perf_counter()

    async def one(at: float, prompt: str, tokens: int) -> StreamStats:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        return await send(prompt, tokens)

    return list(await asyncio.gather(*(one(*r) for r in requests)))


def baseline_envoy(stack: Stack, workdir: Path, lb_policy: str = "LEAST_REQUEST") -> tuple[Proc, int]:
    """The gateway's config without the ext_proc filter, its pool cluster least request (or `lb_policy`)."""
    listen, admin = free_port(), free_port()
    params = stack.envoy_params()
    params = params.__class__(**{**params.__dict__, "listen_port": listen, "admin_port": admin, "eds": False})
    config = yaml.safe_load(render(params, shape_template("eg-buffered")))
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if "ext_proc" not in f["name"]]
    pool = next(c for c in config["static_resources"]["clusters"] if c["name"] == "pool")
    pool.pop("load_balancing_policy", None)
    pool["lb_policy"] = lb_policy
    path = workdir / "envoy-least-request.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = [envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--log-level", "warn"]
    argv += ["--concurrency", "1"]
    proc = Proc("envoy-least-request", argv, workdir / "envoy-least-request.log")
    proc.wait_ready(lambda: health_ok(admin, "/ready") and port_open(listen), timeout=30)
    return proc, listen


def envoy_sender(port: int) -> Send:
    """Each request through a gateway's listener on `port`."""

    async def send(prompt: str, tokens: int) -> StreamStats:
        return await one_stream(port, tokens, itl_s=0.05, prompt=prompt)

    return send


def shim_sender(grpc_port: int, tls: bool, pool: ThreadPoolExecutor) -> Send:
    """Each request as NGINX Gateway Fabric sends it: the shim asks the picker on a new gRPC
    connection, then the request goes straight to the replica named (no response phase)."""
    shim = ShimClient(f"127.0.0.1:{grpc_port}", tls=tls, timeout_s=60.0)

    async def send(prompt: str, tokens: int) -> StreamStats:
        body = b'{"model":"tiny-llama","prompt":"%s","max_tokens":%d,"stream":true}' % (
            prompt.encode(),
            tokens,
        )
        answer = await asyncio.get_running_loop().run_in_executor(pool, shim.ask, body)
        if answer.endpoint is None:
            return StreamStats(status=answer.status or 0, error="refused")
        return await one_stream(int(answer.endpoint.rsplit(":", 1)[1]), tokens, itl_s=0.05, prompt=prompt)

    return send


_COUNTERS = (
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_count",
)


async def served(replicas: Sequence[str]) -> list[tuple[float, ...]]:
    """Each replica's completed requests, and its requests' time waiting for a slot (sum, count), by
    its own counters."""
    async with httpx.AsyncClient(timeout=5) as client:
        pages = [parse_metrics((await client.get(f"http://{r}/metrics")).text) for r in replicas]
    return [tuple(sum(v for (n, _), v in page.items() if n == name) for name in _COUNTERS) for page in pages]


async def data_planes(metrics_port: int) -> str:
    """How the picker says its data-plane connections report ends (`/admin/endpoints`)."""
    async with httpx.AsyncClient(timeout=5) as client:
        listed = (await client.get(f"http://127.0.0.1:{metrics_port}/admin/endpoints")).json()
    return ",".join(sorted(set(listed.get("data_planes", {}).values())))


async def gaps_at_scrapes(metrics_port: int) -> tuple[dict[float, float], str]:
    """The picker's own books-gap histogram (picker_books_gap_requests): le -> scrapes at or below;
    and whether its latency routing was engaged at the end, with the spread `auto` judged by."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
    buckets, latency = {}, {}
    for (name, labels), value in parse_metrics(text).items():
        if name == "picker_books_gap_requests_bucket":
            buckets[float(dict(labels)["le"])] = value
        elif name in ("picker_latency_engaged", "picker_latency_spread"):
            latency[name] = value
    engaged = "engaged" if latency.get("picker_latency_engaged") else "not engaged"
    spread = latency.get("picker_latency_spread")
    return buckets, f"{engaged}, {spread:.2f}x" if spread else engaged


async def load(
    stack: Stack, send: Send, requests: list[tuple[float, str, int]], seconds: float, picker: bool = True
) -> Outcome:
    """Send `requests` on their schedule while sampling the books against the engines' gauges."""
    outcome = Outcome()
    until = time.perf_counter() + seconds + 5
    sampler = asyncio.create_task(
        sample(stack.replicas, stack.metrics_port if picker else None, until, outcome.gaps)
    )
    before = await served(stack.replicas)
    try:
        outcome.stats = await drive(send, requests)
    finally:
        sampler.cancel()
    deltas = [
        [b - a for a, b in zip(one, other, strict=True)]
        for one, other in zip(before, await served(stack.replicas), strict=True)
    ]
    outcome.served = [done for done, _, _ in deltas]
    outcome.queued_ms = [1000 * waited / max(1.0, count) for _, waited, count in deltas]
    if picker:
        outcome.modes = await data_planes(stack.metrics_port)
        outcome.at_scrapes, outcome.latency = await gaps_at_scrapes(stack.metrics_port)
    return outcome


def pool_options(
    row: Row,
    picker_args: tuple[str, ...] = (),
    picker_env: dict[str, str] | None = None,
    replica_args: tuple[tuple[str, ...], ...] = POOL,
) -> StackOptions:
    return StackOptions(
        picker_env=picker_env,
        replicas=len(replica_args),
        sim_args=SIM_COMMON,
        replica_args=replica_args,
        picker_args=("--log-level", "WARNING", *picker_args),
        shape=row.shape,
        envoy_picker_tls=row.shape == "shipped",
        observer=row.observer,
        routing_response_body=row.routing_response_body,
        picker_access_log=row.picker_access_log,
    )


async def run_row(
    row: Row,
    requests: list[tuple[float, str, int]],
    seconds: float,
    workdir: Path,
    picker_args: tuple[str, ...] = (),
    picker_env: dict[str, str] | None = None,
    replica_args: tuple[tuple[str, ...], ...] = POOL,
) -> Outcome:
    stack = Stack(workdir, pool_options(row, picker_args, picker_env, replica_args))
    extra: Proc | None = None
    threads = ThreadPoolExecutor(max_workers=128)
    try:
        stack.start_sims()
        if not row.picker:
            extra, port = baseline_envoy(stack, workdir, row.lb_policy)
            return await load(stack, envoy_sender(port), requests, seconds, picker=False)
        stack.start_picker()
        if row.shim:
            send = shim_sender(stack.grpc_port, stack.options.envoy_picker_tls, threads)
        else:
            stack.start_envoy()
            send = envoy_sender(stack.listen_port)
        return await load(stack, send, requests, seconds)
    finally:
        threads.shutdown(wait=False, cancel_futures=True)
        if extra is not None:
            extra.stop()
        stack.stop()


def ttft_tpot_p90(outcome: Outcome) -> tuple[float, float]:
    """TTFT p90 and time per output token p90 (ms) of the completed streams."""
    ok = [s for s in outcome.stats if s.done and s.status == 200 and s.arrivals]
    ttfts = sorted(s.arrivals[0] - s.started for s in ok)
    tpots = sorted(
        (s.arrivals[-1] - s.arrivals[0]) / (len(s.arrivals) - 1) for s in ok if len(s.arrivals) > 1
    )
    return percentile(ttfts, 90) * 1000, percentile(tpots, 90) * 1000 if tpots else float("nan")


def report(name: str, outcome: Outcome, baseline: tuple[float, float] | None) -> str:
    ok = [s for s in outcome.stats if s.done and s.status == 200 and s.arrivals]
    ttfts = sorted(s.arrivals[0] - s.started for s in ok)
    failed = len(outcome.stats) - len(ok)
    p50, p90 = percentile(ttfts, 50) * 1000, percentile(ttfts, 90) * 1000
    _, tpot90 = ttft_tpot_p90(outcome)
    total = sum(outcome.served) or 1.0
    shares = "/".join(f"{100 * n / total:.0f}" for n in outcome.served)
    gaps = sorted(outcome.gaps)
    books = "-" if not gaps else f"{percentile(gaps, 50):.1f} / {percentile(gaps, 95):.1f} / {gaps[-1]:.0f}"
    within = "-" if not gaps else f"{100 * sum(g <= 1 for g in gaps) / len(gaps):.0f} %"
    ratio = "" if not baseline else f"x{p90 / baseline[0]:.2f} / x{tpot90 / baseline[1]:.2f}"
    modes = outcome.modes or "-"
    counts = f"{failed} of {len(outcome.stats)}"
    queued = "/".join(f"{q:.0f}" for q in outcome.queued_ms)
    scrapes = outcome.at_scrapes
    total = scrapes.get(float("inf"), 0.0)
    at = "-" if not total else f"{100 * scrapes.get(1.0, 0.0) / total:.1f} % of {total:.0f}"
    return (
        f"| {name} | {modes} | {p50:.0f} | {p90:.0f} | {tpot90:.1f} | {ratio} | {counts} | {shares} | {books}"
        f" | {within} | {at} | {outcome.latency or '-'} | {queued} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=55.0, help="requests per second (Poisson)")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long each row sends")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of: {', '.join(ROWS)}")
    parser.add_argument("--seed", type=int, default=45)
    parser.add_argument(
        "--itl-ms", type=float, default=12.0, help="the fast replicas' time per token (the slow one's twice)"
    )
    parser.add_argument("--picker-args", default="", help="more arguments for the picker, space-separated")
    parser.add_argument(
        "--baseline",
        default="",
        help="PYTHONPATH of another picker (an export of main) for rows ending @main or @main-on; run the "
        "bench from a directory without a picker package, for `-m picker` to find it",
    )
    args = parser.parse_args(argv)
    if args.itl_ms <= 0:
        parser.error("--itl-ms must be above 0")
    names = [n for n in args.rows.split(",") if n]
    unknown = [n for n in names if n.split("@")[0] not in ROWS or n.partition("@")[2] not in VARIANTS]
    if unknown:
        parser.error(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    requests = plan(args.rate, args.seconds, args.seed)
    print(f"{len(requests)} requests over {args.seconds:.0f} s ({args.rate:.0f}/s)")
    print(f"pool: 2 fast x 16 slots ({args.itl_ms:g} ms a token), 1 half as fast x 16, 1 fast x 8")
    own50, own90 = own_first_token_ms(requests)
    print(f"the requests' own first token on an idle fast replica: p50 {own50:.0f} ms, p90 {own90:.0f} ms")
    print(
        "| row | ends seen by | TTFT p50 ms | TTFT p90 ms | TPOT p90 ms | TTFT / TPOT p90 vs the better Envoy"
        " | failed | share % fast/fast/half-speed/half-slots | books - engine p50 / p95 / max | within 1"
        " | at the picker's scrapes, within 1 | latency routing at the end"
        " | engine's wait for a slot, mean ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    baseline: tuple[float, float] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-shapes-") as tmp:
        for index, name in enumerate(names):  # a row may come twice (interleaved rounds)
            folder = Path(tmp) / f"{index}-{name}"
            folder.mkdir()
            extra = tuple(args.picker_args.split())
            shape, _, variant = name.partition("@")
            env = {k: v.replace("BASELINE", args.baseline) for k, v in VARIANTS[variant].items()} or None
            outcome = asyncio.run(
                run_row(ROWS[shape], requests, args.seconds, folder, extra, env, pool(args.itl_ms))
            )
            if not ROWS[shape].picker and not ROWS[shape].shim:  # Envoy alone: the better of them
                ttft90, tpot90 = ttft_tpot_p90(outcome)
                baseline = (ttft90, tpot90) if baseline is None else (
                    min(baseline[0], ttft90), min(baseline[1], tpot90)
                )  # fmt: skip
            print(report(name, outcome, baseline), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
