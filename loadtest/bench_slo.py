"""Routing a pool that is not uniform by predicted latency, against today's default, side by side (issue 43).

Four simulated replicas, each in its own process: two normal ones, one half as fast (prefill and
decode: twice the base TTFT and the time per token, half the prefill rate) and one with half the
batch slots; every replica's step grows with its batch (--itl-per-running-ms, 10 % of its time per
token for each other running request, as real vLLM's does). Mixed prompt lengths with shared
prefixes (system prompts of 500 to 3,000 tokens, each request a short question), 24 to 40 tokens
out. The same seeded Poisson arrivals go through each row (`--rows`), side by side:
  rr, lr    the client balancing over the replicas itself: round robin (a Kubernetes Service), least
            requests in flight, the fewer of two at random (Envoy's least-request balancer)
  off       `picker proxy` with load + prefix affinity alone (affinity.latency off)
  auto      the same with affinity.latency auto (the default): the model learns always; the pick
            routes by it once the pool is measurably not uniform
  on        affinity.latency on: each replica's TTFT and time per output token learned online, a
            latency gap and score in the pick; requests wait in the picker for a batch slot
            (earliest due first), not on an engine
  main-off, main-on   off and on with another picker (`--baseline`: the path of an export of main)
Phases (each bounded in time and requests; the prefix caches emptied before each row):
  (a) at 80 % of the pool's capacity: TTFT and TPOT p50/p90/p99, prefix hit rate, each replica's share
  (b) uniform replicas at 60 %; one turns twice as slow 8 s in (POST /sim/speed): its share of new
      work in 2-s windows, and how long after the change it fell below 75 % of its share before
  (c) at 110 %: TTFT SLO 500 ms (x-slo-ttft-ms) on half the requests, priority -1 on a quarter:
      SLO attainment of the admitted, refusals and misses by priority; three seeded arrival
      sequences, each shown, then pooled
  (d) each replica's prediction error (MAPE, from picker_latency_model) after (a)
  (e) the cost of one pick in-process, four candidates: default and with the latency model
Run: `python -m loadtest.bench_slo` (about 7 minutes; `--quick`: shorter windows).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.procs import Proc, free_port, port_open
from loadtest.stack import health_ok, parse_metrics, sim_argv
from loadtest.traffic import percentile

MODEL = "tiny-llama"
BASE = (
    "--ttft-ms", "15", "--itl-ms", "15", "--itl-per-running-ms", "1.5",
    "--prefill-tokens-per-s", "40000", "--max-num-seqs", "6",
)  # fmt: skip
COMMON = (
    "--block-size", "16", "--num-gpu-blocks", "4000", "--kv-capacity-tokens", "4000000",
    "--max-model-len", "64000", "--enable-prompt-tokens-details", "--enable-force-include-usage",
)  # fmt: skip


def mixed(slots: int = 6) -> dict[str, tuple[str, ...]]:
    """The mixed pool, each replica with `slots` batch slots (the half-slots one half of them)."""
    base = (*BASE[:-1], str(slots))
    half_speed = (
        "--ttft-ms", "30", "--itl-ms", "30", "--itl-per-running-ms", "3", "--prefill-tokens-per-s", "20000",
        "--max-num-seqs", str(slots),
    )  # fmt: skip
    return {
        "normal-1": base,
        "normal-2": base,
        "half-speed": half_speed,
        "half-slots": (*BASE[:-1], str(slots // 2)),
    }


MIXED = mixed()


def _serves(ttft_s: float, itl_s: float, per_running_s: float, slots: int) -> float:
    """Requests/s one replica serves with every slot busy: slots / (TTFT + 32 tokens x the step of a
    full batch)."""
    return slots / (ttft_s + 32 * (itl_s + per_running_s * (slots - 1)))


def capacity(slots: int = 6) -> float:
    """What the mixed pool can serve (requests/s), summed over the replicas."""
    normal, half = _serves(0.015, 0.015, 0.0015, slots), _serves(0.03, 0.03, 0.003, slots)
    return 2 * normal + half + _serves(0.015, 0.015, 0.0015, slots // 2)


CAPACITY = capacity()


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    by_replica: Counter[str] = field(default_factory=Counter)
    starts: list[tuple[float, str]] = field(default_factory=list)  # (sent, replica)
    served: list[tuple[str, float]] = field(default_factory=list)  # (replica, TTFT)
    failed: Counter[str] = field(default_factory=Counter)  # reason -> count
    refused_by_priority: Counter[int] = field(default_factory=Counter)
    slo_total: int = 0
    slo_met: int = 0
    slo_missed_by_priority: Counter[int] = field(default_factory=Counter)
    hits: float = 0.0


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(count))


class Workload:
    """System prompts of 500-3,000 tokens shared by groups; each request a new short question."""

    def __init__(self, seed: int, slo: bool = False) -> None:
        rng = random.Random(seed)
        self.prompts = [f"System {g}. " + _words(rng, rng.randint(300, 1700)) for g in range(24)]
        self.rng = random.Random(seed + 1)
        self.slo = slo

    def next(self) -> tuple[dict[str, object], dict[str, str], int]:
        rng = self.rng
        prompt = rng.choice(self.prompts) + "\nQuestion: " + _words(rng, 20)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(24, 40), "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
        headers: dict[str, str] = {}
        priority = 0
        if self.slo:
            if rng.random() < 0.5:
                headers["x-slo-ttft-ms"] = "500"
            if rng.random() < 0.25:
                priority = -1
                headers["x-gateway-inference-priority"] = "-1"
        return body, headers, priority


class Client:
    """Where the client sends each request: one URL (a picker), or the replicas themselves by round
    robin (`rr`, a Kubernetes Service) or by least requests in flight from this client (`lr`, as
    Envoy's least-request balancer: the fewer of two chosen at random)."""

    def __init__(self, target: str | Sequence[str], how: str = "", seed: int = 0) -> None:
        self.urls = [target] if isinstance(target, str) else list(target)
        self.how = how
        self.turn = 0
        self.in_flight = dict.fromkeys(self.urls, 0)
        self.rng = random.Random(seed)

    def take(self) -> str:
        if self.how == "rr":
            self.turn += 1
            url = self.urls[self.turn % len(self.urls)]
        elif self.how == "lr":
            a, b = self.rng.sample(self.urls, 2)
            url = a if self.in_flight[a] <= self.in_flight[b] else b
        else:
            url = self.urls[0]
        self.in_flight[url] += 1
        return url

    def give(self, url: str) -> None:
        self.in_flight[url] -= 1


async def one(
    session: aiohttp.ClientSession, client: Client, body: dict[str, object], headers: dict[str, str],
    priority: int, out: Outcome | None,
) -> None:  # fmt: skip
    url = client.take()
    try:
        await _one(session, url, body, headers, priority, out)
    finally:
        client.give(url)


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, object], headers: dict[str, str],
    priority: int, out: Outcome | None,
) -> None:  # fmt: skip
    sent = time.monotonic()
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                await response.read()
                if out is not None:
                    reason = response.headers.get("x-picker-dropped-reason", str(response.status))
                    out.failed[reason] += 1
                    out.refused_by_priority[priority] += 1
                return
            replica = response.headers.get("x-sim-replica", "")
            first = last = None
            chunks = 0
            async for chunk in response.content.iter_any():
                now = time.monotonic()
                if first is None:
                    first = now
                last = now
                chunks += chunk.count(b'"text"')
    except (aiohttp.ClientError, TimeoutError):
        if out is not None:
            out.failed["transport"] += 1
        return
    if out is None or first is None or last is None:
        return
    ttft = first - sent
    out.ttft.append(ttft)
    out.by_replica[replica] += 1
    out.starts.append((sent, replica))
    out.served.append((replica, ttft))
    if chunks > 1:
        out.tpot.append((last - first) / (chunks - 1))
    if "x-slo-ttft-ms" in headers:
        out.slo_total += 1
        out.slo_met += ttft <= 0.5
        if ttft > 0.5:
            out.slo_missed_by_priority[priority] += 1


async def hit_counters(replicas: Sequence[str]) -> tuple[float, float]:
    queries = hits = 0.0
    async with aiohttp.ClientSession() as session:
        for replica in replicas:
            async with session.get(f"http://{replica}/metrics") as response:
                page = parse_metrics(await response.text())
            queries += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_queries_total")
            hits += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_hits_total")
    return queries, hits


async def post_all(urls: Sequence[str], body: dict[str, object] | None = None) -> None:
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.post(url, json=body) as response:
                await response.read()


async def phase(
    url: str | Client, workload: Workload, rate: float, warmup_s: float, measure_s: float,
    replicas: Sequence[str], seed: int, event_at: float | None = None, event: object = None,
) -> Outcome:  # fmt: skip
    """Poisson arrivals at `rate` (bounded in count and time): a warm-up, then the measured window."""
    await post_all([f"http://{r}/reset_prefix_cache" for r in replicas])
    rng = random.Random(seed)
    client = url if isinstance(url, Client) else Client(url)
    out = Outcome()
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.monotonic()
        measure_from, end = start + warmup_s, start + warmup_s + measure_s
        before = (0.0, 0.0)
        measuring = False
        fired = False
        next_at, issued, limit = start, 0, int(rate * (warmup_s + measure_s) * 2) + 10
        while issued < limit and (now := time.monotonic()) < end:
            if not measuring and now >= measure_from:
                measuring, before = True, await hit_counters(replicas)
            if event_at is not None and not fired and now >= measure_from + event_at:
                fired = True
                await event  # type: ignore[misc]
            if next_at > now:
                await asyncio.sleep(next_at - now)  # the arrival schedule, not a synchronisation
                continue
            body, headers, priority = workload.next()
            task = asyncio.create_task(
                one(session, client, body, headers, priority, out if measuring else None)
            )
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            issued += 1
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=60)
    after = await hit_counters(replicas)
    queries = after[0] - before[0]
    out.hits = (after[1] - before[1]) / queries if queries else 0.0
    return out


def ms(values: list[float], q: float) -> float:
    return percentile(sorted(values), q) * 1e3 if values else float("nan")


def lower(new: list[float], base: list[float]) -> float:
    """How much lower the p90 of `new` is than that of `base`, in percent."""
    return 100 * (1 - ms(new, 90) / ms(base, 90))


def start_proxy(
    workdir: Path, name: str, replicas: Sequence[str], env: dict[str, str], cwd: Path | None = None
) -> tuple[Proc, str, str]:
    port, metrics = free_port(), free_port()
    argv = [
        sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics), "--endpoints", ",".join(replicas), "--log-level", "WARNING",
    ]  # fmt: skip
    proc = Proc(f"proxy-{name}", argv, workdir / f"proxy-{name}.log", env=env, cwd=cwd)
    proc.wait_ready(lambda: "picker proxy ready" in proc.log_text() and port_open(port))
    return proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics}"


async def model_errors(admin: str) -> dict[str, dict[str, float]]:
    async with aiohttp.ClientSession() as session, session.get(f"{admin}/metrics") as response:
        page = parse_metrics(await response.text())
    out: dict[str, dict[str, float]] = {}
    for (name, labels), value in page.items():
        if name == "picker_latency_model":
            tags = dict(labels)
            out.setdefault(tags["endpoint"], {})[tags["figure"]] = value
    return out


def pick_cost(picks: int, blocks: int = 10) -> dict[str, float]:
    """Microseconds per pick, four candidates with load samples, by `affinity.latency`: off, auto on
    a uniform pool (not engaged: the model learns from the primary alone), on (every candidate
    predicted). The settings alternate in blocks (warm-up and the machine's other work fall on all
    alike); each is the median of its blocks."""
    from picker.config.model import AffinityConfig
    from picker.observability.metrics import Metrics
    from picker.pool import EndpointState, Pool
    from picker.pool.load import LoadSample
    from picker.request.inference import InferenceRequest
    from picker.request.placement import Placement
    from picker.scheduling import LoadPolicy
    from picker.streams import RequestRecord

    setups = {}
    for latency in ("off", "auto", "on"):
        pool = Pool()
        addresses = [f"10.0.0.{i}:8000" for i in range(1, 5)]
        pool.reconcile(dict.fromkeys(addresses, EndpointState.READY), "bench")
        for i, endpoint in enumerate(pool.endpoints()):
            endpoint.load = LoadSample(float(i), 0.0, 0.1, 0.0, 0, 0)
        placement = Placement(pool, AffinityConfig(latency=latency), Metrics(pool="default"), None)  # type: ignore[arg-type]
        request = InferenceRequest(
            method="POST", path="/v1/completions", model="m", stream=True, prompt=b"x" * 4000
        )
        record = RequestRecord(request_id="r", admitted_at=0.0, keys=placement.keys(request, None, None))
        setups[latency] = (placement, record, pool.ready())
    per_block = max(1, picks // blocks)
    times: dict[str, list[float]] = {name: [] for name in setups}
    rng, policy = random.Random(1), LoadPolicy()
    for _ in range(blocks):
        for name, (placement, record, candidates) in setups.items():
            started = time.perf_counter()
            for _ in range(per_block):
                placement.choose(record, candidates, 3, rng, 0.5, policy, frozenset())
            times[name].append((time.perf_counter() - started) / per_block * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


@dataclass
class Setup:
    """One row: a picker (its URL and admin URL), or the client balancing over the replicas itself."""

    urls: list[str]
    admin: str = ""
    how: str = ""  # "rr", "lr" (the client's own balancing), "" (a picker)

    def client(self) -> Client:
        return Client(self.urls if self.how else self.urls[0], self.how)


Setups = dict[str, Setup]

# The rows --rows may name: the client's own balancing, or a picker with these settings (--baseline
# adds main-off and main-on: the same settings with the picker found at that path, e.g. a copy of main)
ROWS: dict[str, dict[str, str] | str] = {
    "rr": "rr",
    "lr": "lr",
    "off": {"PICKER_AFFINITY__LATENCY": "off"},
    "auto": {},
    "on": {"PICKER_AFFINITY__LATENCY": "on"},
    "main-off": {"PICKER_AFFINITY__LATENCY": "false"},
    "main-on": {"PICKER_AFFINITY__LATENCY": "true"},
}


def start_rows(workdir: Path, replicas: list[str], args: argparse.Namespace, procs: list[Proc]) -> Setups:
    setups: Setups = {}
    extra_env = dict(item.split("=", 1) for item in args.latency_env)
    for name in args.rows.split(","):
        spec = ROWS[name]
        if isinstance(spec, str):
            setups[name] = Setup([f"http://{r}" for r in replicas], how=spec)
            continue
        env = {**spec, **(extra_env if name != "off" else {})}
        cwd = Path(args.baseline) if name.startswith("main-") else None  # `-m picker` finds that copy
        proc, url, admin = start_proxy(workdir, name, replicas, env, cwd)
        procs.append(proc)
        setups[name] = Setup([url], admin)
    return setups


def by_replica(values: list[tuple[str, float]], replicas: Sequence[str], names: dict[str, str]) -> str:
    """Each replica's share of the requests and its TTFT p90."""
    parts = []
    for replica in replicas:
        mine = [v for r, v in values if r == replica]
        parts.append(f"{names[replica]}={len(mine) * 100 // max(1, len(values))}%/{ms(mine, 90):.0f}ms")
    return " ".join(parts)


async def phase_a(
    setups: Setups,
    replicas: list[str],
    names: dict[str, str],
    windows: tuple[float, float],
    loads: Sequence[float] = (0.8,),
    pool_capacity: float = CAPACITY,
) -> None:
    for load in loads:
        rate = load * pool_capacity
        print(f"\n(a) {load * 100:.0f} % of capacity ({rate:.1f} req/s), mixed prompts with shared prefixes")
        print(
            "  row         ok fail  TTFT p50  TTFT p90  TTFT p99  TPOT p50  TPOT p90   hit %  share/TTFT p90"
        )
        rows = {}
        for name, setup in setups.items():
            out = rows[name] = await phase(setup.client(), Workload(seed=1), rate, *windows, replicas, seed=2)
            print(
                f"  {name:<9} {len(out.ttft):>5} {sum(out.failed.values()):>4} {ms(out.ttft, 50):>8.0f}ms"
                f" {ms(out.ttft, 90):>7.0f}ms {ms(out.ttft, 99):>7.0f}ms {ms(out.tpot, 50):>7.1f}ms"
                f" {ms(out.tpot, 90):>7.1f}ms {out.hits * 100:>6.1f}"
                f"  {by_replica(out.served, replicas, names)}",
                flush=True,
            )
        baselines = [rows[name] for name in ("rr", "lr") if name in rows]
        if baselines:
            ttft90 = min(ms(out.ttft, 90) for out in baselines)
            tpot90 = min(ms(out.tpot, 90) for out in baselines)
            print("  against the better of rr / lr (p90 ratio; goal <= 0.6):")
            for name, out in rows.items():
                if name not in ("rr", "lr"):
                    print(
                        f"    {name:<9} TTFT p90 x{ms(out.ttft, 90) / ttft90:.2f}"
                        f"  TPOT p90 x{ms(out.tpot, 90) / tpot90:.2f}"
                    )
    for name, setup in setups.items():
        if not setup.admin or name.endswith("off"):
            continue
        async with aiohttp.ClientSession() as session, session.get(f"{setup.admin}/metrics") as response:
            page = parse_metrics(await response.text())
        engaged = page.get(("picker_latency_engaged", ()), float("nan"))
        spread = page.get(("picker_latency_spread", ()), float("nan"))
        print(f"\n(d) {name}: latency engaged {engaged:.0f} (spread {spread:.2f}) after (a)")
        print(f"  prediction error after (a), {name}: MAPE per replica (TTFT, TPOT)")
        for address, figures in sorted((await model_errors(setup.admin)).items()):
            ttft, tpot = (figures.get(f"{k}_mape", float("nan")) * 100 for k in ("ttft", "tpot"))
            print(f"  {names.get(address, address):<11} ttft {ttft:5.1f}%  tpot {tpot:5.1f}%")


async def phase_b(setups: Setups, replicas: list[str]) -> None:
    """A uniform pool (every replica as `normal`), one replica twice as slow 8 s in."""
    slow, change_at, window, length = replicas[0], 8.0, 2.0, 20.0
    print("\n(b) one replica turns twice as slow 8 s in, 60 % of capacity: its share of new work (%)")
    for name, setup in setups.items():
        await post_all([f"http://{r}/sim/speed" for r in replicas], {"slowdown": 1.0})
        change = post_all([f"http://{slow}/sim/speed"], {"slowdown": 2.0})
        rate = 0.6 * CAPACITY
        out = await phase(setup.client(), Workload(seed=3), rate, 2.0, length, replicas, 4, change_at, change)
        started = min(t for t, _ in out.starts)
        shares = []
        for k in range(int(length / window)):
            inside = [r for t, r in out.starts if started + k * window <= t < started + (k + 1) * window]
            shares.append(sum(r == slow for r in inside) / max(1, len(inside)))
        before = sum(shares[: int(change_at / window)]) / int(change_at / window)
        after = [
            k * window - change_at
            for k, v in enumerate(shares)
            if k * window >= change_at and v < 0.75 * before
        ]
        fell = f"{after[0]:.0f}-{after[0] + window:.0f} s after" if after else "never"
        later = shares[int(change_at / window) :]
        print(
            f"  {name:<8} per {window:.0f} s: "
            + " ".join(f"{v * 100:3.0f}" for v in shares)
            + f"  (before {before * 100:.0f}; below 75 % of it: {fell};"
            f" mean after {sum(later) / len(later) * 100:.0f})",
            flush=True,
        )
    await post_all([f"http://{r}/sim/speed" for r in replicas], {"slowdown": 1.0})


async def phase_c(setups: Setups, replicas: list[str], windows: tuple[float, float], seeds: int) -> None:
    """Each row over `seeds` seeded arrival sequences (one sequence's bursts decide much of a 20-s
    window at overload), each sequence's figures, then all of them pooled."""
    over = 1.1 * CAPACITY
    print(f"\n(c) 110 % of capacity ({over:.1f} req/s): TTFT SLO 500 ms on half, priority -1 on a quarter")
    print("  row      seq    ok  SLO met (of admitted with one)  refused by priority  missed by priority")
    pooled: dict[str, list[int]] = {name: [0, 0] for name in setups}
    for seed in range(seeds):
        for name, setup in setups.items():
            out = await phase(
                setup.client(), Workload(seed=5 + seed, slo=True), over, *windows, replicas, seed=6 + seed
            )
            met = out.slo_met / out.slo_total if out.slo_total else float("nan")
            pooled[name][0] += out.slo_met
            pooled[name][1] += out.slo_total
            print(
                f"  {name:<8} {seed:>3} {len(out.ttft):>5}  {met * 100:>6.1f}% of {out.slo_total:<5}"
                f"                {dict(out.refused_by_priority)!s:<20} {dict(out.slo_missed_by_priority)}"
                f"  {dict(out.failed)}",
                flush=True,
            )
    for name, (met_count, total) in pooled.items():
        print(f"  {name:<8} all sequences: {met_count * 100 / max(1, total):.1f}% of {total} met their SLO")


async def run(args: argparse.Namespace) -> None:
    windows = (4.0, 10.0) if args.quick else (6.0, args.measure_s)
    with tempfile.TemporaryDirectory(prefix="bench-slo-") as tmp:
        workdir = Path(tmp)
        pool, pool_capacity = mixed(args.slots), capacity(args.slots)
        ports = {name: free_port() for name in pool}
        replicas = [f"127.0.0.1:{p}" for p in ports.values()]
        names = {f"127.0.0.1:{p}": name for name, p in ports.items()}
        sims = {
            name: Proc(f"sim-{name}", sim_argv([port], [*pool[name], *COMMON]), workdir / f"sim-{name}.log")
            for name, port in ports.items()
        }
        proxies: list[Proc] = []
        try:
            for name, sim in sims.items():
                sim.wait_ready(lambda p=ports[name]: health_ok(p))
            setups = start_rows(workdir, replicas, args, proxies)
            print(
                f"bench_slo: 2 normal replicas, 1 half speed, 1 half slots, {args.slots} slots each:"
                f" ~{pool_capacity:.0f} req/s"
            )
            print(
                f"each phase: {windows[0]:.0f} s warm-up + {windows[1]:.0f} s measured; same arrivals per row"
            )
            if "a" in args.only:
                loads = [float(x) for x in args.loads.split(",")]
                if args.rates:
                    loads = [float(x) / pool_capacity for x in args.rates.split(",")]
                await phase_a(setups, replicas, names, windows, loads, pool_capacity)
            if "c" in args.only:
                await phase_c(setups, replicas, windows, args.sequences)
        finally:
            for proc in proxies:
                proc.stop()
            for sim in sims.values():
                sim.stop()
    if "b" in args.only:
        await uniform_phase_b(args)
    if "e" in args.only:
        cost = pick_cost(20000)
        print(
            f"\n(e) one pick in-process, 4 candidates, affinity.latency: off {cost['off']:.1f} us,"
            f" auto on a uniform pool {cost['auto']:.1f} us, on {cost['on']:.1f} us"
        )


async def uniform_phase_b(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-slo-b-") as tmp:
        workdir = Path(tmp)
        ports = [free_port() for _ in MIXED]
        replicas = [f"127.0.0.1:{p}" for p in ports]
        sim = Proc("sim-uniform", sim_argv(ports, [*BASE, *COMMON]), workdir / "sim.log")
        proxies: list[Proc] = []
        try:
            for port in ports:
                sim.wait_ready(lambda p=port: health_ok(p))
            setups = start_rows(workdir, replicas, args, proxies)
            await phase_b(setups, replicas)
        finally:
            for proc in proxies:
                proc.stop()
            sim.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter windows")
    parser.add_argument("--only", default="abcde", help="the phases to run (default: all)")
    parser.add_argument("--measure-s", type=float, default=20.0, help="(a), (c): seconds measured per row")
    parser.add_argument("--sequences", type=int, default=3, help="(c): seeded arrival sequences per row")
    parser.add_argument(
        "--latency-env",
        action="append",
        default=[],
        help="KEY=VALUE for every picker row but off (a setting)",
    )
    parser.add_argument(
        "--rows",
        default="rr,lr,off,auto,on",
        help=f"the rows, side by side (of {', '.join(ROWS)}; main-* need --baseline)",
    )
    parser.add_argument(
        "--baseline",
        default="",
        help="PYTHONPATH of another picker for the main-off / main-on rows (e.g. an export of main)",
    )
    parser.add_argument("--loads", default="0.8", help="(a): shares of the pool's capacity, comma-separated")
    parser.add_argument("--rates", default="", help="(a): or these request rates (req/s), comma-separated")
    parser.add_argument(
        "--slots", type=int, default=6, help="(a), (c): each replica's batch slots (the half-slots one half)"
    )
    import uvloop

    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
