"""A routing proving ground (issue 63, item 3): pool shapes x workloads, the picker's defaults beside
Envoy alone (round robin, least request) and prefix-then-load, each row's columns side by side in one run.

Rows are a pool shape x a workload. Every replica is simulated (sim/vllm_sim): a base speed of 20 ms to
the first token plus 0.03 ms per uncached prompt token, 12 ms a token after it, 8 running slots, vLLM's
prefix caching on (blocks of 16 tokens). Replicas with the same slots share one simulator process (at
most 8 ports each: the machine has two cores); a slower replica is the same replica slowed with
`POST /sim/speed` (every duration x the factor).

Pools:
  uniform      4 replicas alike
  one-slow     4, one of them 2x slower
  half-slow    4, two of them 2x slower
  most-slow    4, three of them 2x slower
  fewer-slots  4, one with half the slots (4)
  two          2 replicas alike
  eight        8, two of them 2x slower
  sixteen      16 alike, 4 slots each (8 each would ask for ~110 requests/s at 0.7: more than two
               cores carry through Envoy, the picker and the simulators)
  restart      4, one just back from a restart: 5x slower for the first 30 % of the run (warming up),
               its prefix cache as empty as the others' at the start of every column
Workloads:
  plain        no shared prefix: prompts of 50-2,000 words (~100-4,200 tokens), 20-100 tokens out
  shared       heavy shared prefixes: 2 groups per replica (at least 6) of ~3,000-token system prompts
               with a short question each; each replica's prefix cache holds three system prompts
               (perfect affinity needs two), so where a group goes decides the hit rate
  long-prompt  unique prompts of 4,000-12,000 tokens, 20-60 tokens out
  long-output  prompts of 20-200 words, 150-300 tokens out
  bursts       the plain requests, arriving in bursts: 0.5 s at 3x the mean rate, then 1.5 s at 1/3 of it

Columns (each row runs once per column, with the same seeded arrivals and requests):
  picker       the picker with its defaults, behind the shipped Envoy config (TLS, the observer filter)
  picker-fd    the same picker behind Envoy AI Gateway's FULL_DUPLEX_STREAMED shape (bench_shapes'
               aigw-full-duplex: every chunk waits on the picker)
  rr, lr       Envoy alone, round robin / least request (the gateway config without ext_proc)
  prefix       the picker with affinity.latency off (PICKER_AFFINITY__LATENCY=off): prefix affinity,
               then load; the reference's default stack

Rate per row: `--load` (default 0.7) x the pool's capacity, computed from the simulators' arguments
as the sum over replicas of slots / (slowdown x the mean slot time of the workload's requests:
ttft + per-token prefill x prompt tokens, uncached + output tokens x itl). Per cell: TTFT p50/p90,
TPOT p90 (ms), the prefix-cache hit rate (the simulators' own vllm:prefix_cache_hits/queries
counters), each replica's share of the requests (its own vllm:request_success_total; s = a slower
replica, h = fewer slots, r = the restarting one), failures, the picker's CPU seconds per 1,000 requests
(/proc/<pid>/stat), and for picker columns affinity.latency auto: engaged at the end, the share of
1 s samples engaged, the flips (the picker's "affinity.latency auto: engaged/released" log lines).
Then per row: the picker's TTFT p90 (and picker-fd's) over the best of rr, lr and prefix.

A row's simulators live through its columns (each column: engines idle, prefix caches emptied, speeds
set again); every column starts its own gateway, and its own picker (cold, at its default log level).
Bounded: each cell sends rate x `--seconds` requests and stops at `--seconds` + `--grace`; every
process is stopped by its PID. The default run (10 rows x 5 columns, 10 s each) takes ~12 minutes on
two cores. On `shared` rows an `oracle` column sends each request straight to the replica its
group is pinned to, the groups dealt out in proportion to each replica's capacity (slots /
slowdown) and never more to one replica than its cache holds: perfect affinity with a
capacity-aware placement, no gateway. Per row, the **floor**: the TTFT p90 the same requests would
have if each ran alone on an idle base replica holding every shared prefix already (its own uncached
prompt tokens only; no queue, no slow replica, no cold cache). No policy goes below it; where the
best simple policy is already near it, no policy can do much better than that policy on the row.
And the **clairvoyant** reading (loadtest/clairvoyant.py): the same requests replayed through the
simulators' model by a dispatcher that knows every request, slot and cache, each sent where its
first token comes soonest: what the queues leave above the floor, without the gateway's path.

    python -m loadtest.bench_routing [--rows uniform/plain,eight/bursts] [--columns picker,lr]
        [--seconds 10] [--load 0.7] [--seed 63]

`--rows` takes any pool/workload pair, not only the default ones (`--rows list` prints them all).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx

from loadtest import clairvoyant
from loadtest.bench_shapes import WORDS, baseline_envoy, envoy_sender, prompt_tokens
from loadtest.procs import Proc
from loadtest.rawclient import StreamStats, cpu_seconds
from loadtest.stack import Stack, StackOptions, health_ok, parse_metrics, sim_argv
from loadtest.traffic import percentile

# the base replica (the simulator's latency model): slot time = TTFT + prefill + tokens x ITL
TTFT_MS, ITL_MS, PREFILL_MS_PER_TOKEN, SLOTS = 20.0, 12.0, 0.03, 8
BLOCK_TOKENS = 16
SIM_BASE = (
    "--ttft-ms", f"{TTFT_MS:g}", "--itl-ms", f"{ITL_MS:g}",
    "--ttft-per-prompt-token-ms", f"{PREFILL_MS_PER_TOKEN:g}",
    "--max-model-len", "16384", "--block-size", str(BLOCK_TOKENS), "--log-level", "WARNING",
)  # fmt: skip
PORTS_PER_SIM = 8
WARM_FACTOR, WARM_SHARE = 5.0, 0.3  # the restarting replica: this much slower for this share of the run


# --- pools ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    name: str
    slots: tuple[int, ...]
    slowdown: tuple[float, ...]
    warming: int | None = None  # the replica just back from a restart (slower at first)

    @property
    def size(self) -> int:
        return len(self.slots)

    def marks(self) -> list[str]:
        """Per replica: 's' slower, 'h' fewer slots, 'r' restarting, '' otherwise."""
        top = max(self.slots)
        return [
            ("r" if i == self.warming else "") + ("s" if f > 1 else "") + ("h" if n < top else "")
            for i, (n, f) in enumerate(zip(self.slots, self.slowdown, strict=True))
        ]


def _pool(
    name: str, size: int, slow: int = 0, slots: int = SLOTS, half: int = 0, warming: bool = False
) -> Pool:
    return Pool(
        name,
        tuple(slots // 2 if i >= size - half else slots for i in range(size)),
        tuple(2.0 if i >= size - slow else 1.0 for i in range(size)),
        0 if warming else None,
    )


POOLS: dict[str, Pool] = {
    p.name: p
    for p in (
        _pool("uniform", 4),
        _pool("one-slow", 4, slow=1),
        _pool("half-slow", 4, slow=2),
        _pool("most-slow", 4, slow=3),
        _pool("fewer-slots", 4, half=1),
        _pool("two", 2),
        _pool("eight", 8, slow=2),
        _pool("sixteen", 16, slots=4),
        _pool("restart", 4, warming=True),
    )
}


# --- workloads ------------------------------------------------------------------------------------


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(count))


def _text(rng: random.Random, tokens: int) -> str:
    """Unique text of about `tokens` simulator tokens."""
    out: list[str] = []
    size = 0
    while size < tokens * 4:
        word = f"w{rng.randrange(1_000_000)}"
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


SYSTEM_TOKENS = 3000
SYSTEM_MARK = "System prompt "  # a `shared` prompt starts with it and its group's number
CACHED_PROMPTS = 3  # system prompts each replica's prefix cache holds in `shared`


@dataclass(frozen=True)
class Workload:
    name: str
    bursts: bool = False

    def groups(self, pool: Pool) -> int:
        return max(6, 2 * pool.size) if self.name == "shared" else 0

    def sim_args(self) -> tuple[str, ...]:
        """`shared`: a prefix cache of three system prompts (plus room for the questions)."""
        if self.name != "shared":
            return ()
        blocks = CACHED_PROMPTS * math.ceil(SYSTEM_TOKENS / BLOCK_TOKENS) + 128
        return ("--num-gpu-blocks", str(blocks))

    def generator(self, pool: Pool, seed: int) -> Callable[[], tuple[str, int]]:
        """Draws (prompt, max_tokens), seeded."""
        rng = random.Random(seed)
        if self.name == "shared":
            systems = [f"{SYSTEM_MARK}{g}. " + _text(random.Random(seed * 1000 + g), SYSTEM_TOKENS) for g in
                       range(self.groups(pool))]  # fmt: skip

            def shared() -> tuple[str, int]:
                prompt = rng.choice(systems) + SHARED_MARK + _words(rng, rng.randint(20, 60))
                return prompt, rng.randint(20, 100)

            return shared
        if self.name == "long-prompt":
            return lambda: (_text(rng, rng.randint(4000, 12000)), rng.randint(20, 60))
        if self.name == "long-output":
            return lambda: (_words(rng, rng.randint(20, 200)), rng.randint(150, 300))
        return lambda: (_words(rng, rng.randint(50, 2000)), rng.randint(20, 100))  # plain, bursts


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("plain"),
        Workload("shared"),
        Workload("long-prompt"),
        Workload("long-output"),
        Workload("bursts", bursts=True),
    )
}


def slot_seconds(prompt: str, tokens: int) -> float:
    """How long a request holds a slot on a base replica, its prompt uncached."""
    return (TTFT_MS + PREFILL_MS_PER_TOKEN * prompt_tokens(prompt) + ITL_MS * tokens) / 1000.0


def capacity(pool: Pool, mean_slot_s: float) -> float:
    """Requests per second the pool completes with every slot busy (steady speeds)."""
    return sum(n / (f * mean_slot_s) for n, f in zip(pool.slots, pool.slowdown, strict=True))


def arrivals(rate: float, seconds: float, rng: random.Random, bursts: bool = False) -> list[float]:
    """Poisson arrival times in [0, seconds); `bursts`: 0.5 s at 3x `rate`, 1.5 s at rate / 3, repeated
    (the same mean rate)."""
    out: list[float] = []
    at = 0.0
    while at < seconds:
        if not bursts:
            at += rng.expovariate(rate)
            if at < seconds:
                out.append(at)
            continue
        phase_end = (at // 2.0) * 2.0 + (0.5 if at % 2.0 < 0.5 else 2.0)
        now_rate = 3 * rate if at % 2.0 < 0.5 else rate / 3
        step = rng.expovariate(now_rate)
        if at + step >= phase_end:  # memoryless: start over at the phase boundary
            at = phase_end
            continue
        at += step
        if at < seconds:
            out.append(at)
    return out


@dataclass(frozen=True)
class Row:
    pool: Pool
    workload: Workload

    @property
    def name(self) -> str:
        return f"{self.pool.name}/{self.workload.name}"


DEFAULT_ROWS = (  # every pool once (one-slow twice), every workload at least twice; ~12 minutes
    "uniform/shared",
    "one-slow/plain",
    "half-slow/shared",
    "most-slow/long-output",
    "fewer-slots/long-prompt",
    "two/long-output",
    "eight/bursts",
    "sixteen/plain",
    "restart/bursts",
    "one-slow/long-prompt",
)


def parse_rows(text: str) -> list[Row]:
    """`pool/workload,...`; ValueError naming an unknown pool or workload."""
    rows = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        pool, _, workload = name.partition("/")
        if pool not in POOLS or workload not in WORKLOADS:
            raise ValueError(
                f"unknown row {name!r}: pool/workload with pools {', '.join(POOLS)} and workloads "
                f"{', '.join(WORKLOADS)}"
            )
        rows.append(Row(POOLS[pool], WORKLOADS[workload]))
    return rows


@dataclass(frozen=True)
class Plan:
    rate: float
    capacity: float
    requests: list[tuple[float, str, int]]  # (offset s, prompt, max_tokens)

    @property
    def floor_ms(self) -> float:
        """The TTFT p90 of these requests each alone on an idle base replica that holds every
        shared prefix (see the module's docstring)."""
        return percentile([alone_ttft_ms(prompt) for _, prompt, _ in self.requests], 90)


SHARED_MARK = " Question: "  # where a `shared` prompt's system prompt ends


def held_tokens(prompt: str) -> int:
    """The prompt tokens a replica holding its system prompt has cached (whole blocks); 0 unshared."""
    shared = prompt.find(SHARED_MARK)
    return (prompt_tokens(prompt[:shared]) // BLOCK_TOKENS) * BLOCK_TOKENS if shared > 0 else 0


def group_of(prompt: str) -> int | None:
    """A `shared` prompt's group (the number after SYSTEM_MARK); None for any other prompt."""
    if not prompt.startswith(SYSTEM_MARK):
        return None
    return int(prompt[len(SYSTEM_MARK) :].split(".", 1)[0])


def alone_ttft_ms(prompt: str) -> float:
    """A request's TTFT alone on an idle base replica holding its system prompt (whole blocks)."""
    return TTFT_MS + PREFILL_MS_PER_TOKEN * (prompt_tokens(prompt) - held_tokens(prompt))


def clairvoyant_ms(row: Row, plan: Plan, seconds: float) -> float:
    """The TTFT p90 of the row's requests sent by a dispatcher that knows every request, slot and
    cache (loadtest/clairvoyant.py), on the simulators' own model of the pool."""
    pool = row.pool
    replicas = [
        clairvoyant.Replica(slots, factor)
        if index != pool.warming
        else clairvoyant.Replica(slots, factor, WARM_FACTOR, WARM_SHARE * seconds)
        for index, (slots, factor) in enumerate(zip(pool.slots, pool.slowdown, strict=True))
    ]
    requests = [
        clairvoyant.Request(at, prompt_tokens(prompt), tokens, group_of(prompt), held_tokens(prompt))
        for at, prompt, tokens in plan.requests
    ]
    cached = CACHED_PROMPTS if row.workload.groups(pool) else 0
    model = clairvoyant.Model(TTFT_MS, PREFILL_MS_PER_TOKEN, ITL_MS, cached)
    return percentile(sorted(clairvoyant.dispatch(replicas, requests, model)), 90)


def make_plan(row: Row, load: float, seconds: float, seed: int) -> Plan:
    """The row's requests: the rate from the pool's capacity for this workload, seeded arrivals."""
    sample = row.workload.generator(row.pool, seed + 7)
    mean_slot = sum(slot_seconds(*sample()) for _ in range(400)) / 400
    cap = capacity(row.pool, mean_slot)
    rate = load * cap
    draw = row.workload.generator(row.pool, seed)
    times = arrivals(rate, seconds, random.Random(seed + 1), row.workload.bursts)
    return Plan(rate, cap, [(at, *draw()) for at in times])


# --- columns --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    name: str
    picker: bool = True
    shape: str = "shipped"
    lb_policy: str = ""
    env: tuple[tuple[str, str], ...] = ()
    oracle: bool = False  # straight to the replica each prompt group is pinned to (`shared` rows)


COLUMNS: dict[str, Column] = {
    c.name: c
    for c in (
        Column("picker"),
        Column("picker-fd", shape="aigw-failopen"),
        Column("rr", picker=False, lb_policy="ROUND_ROBIN"),
        Column("lr", picker=False, lb_policy="LEAST_REQUEST"),
        Column("prefix", env=(("PICKER_AFFINITY__LATENCY", "off"),)),
        # not in the default run: the picker with its predictions always on, and with requests
        # waiting on the engines (one each) rather than in the picker while auto is engaged
        Column("picker-on", env=(("PICKER_AFFINITY__LATENCY", "on"),)),
        Column("picker-q1", env=(("PICKER_AFFINITY__LATENCY_ENGINE_QUEUE", "1"),)),
        Column("oracle", picker=False, oracle=True),
    )
}
DEFAULT_COLUMNS = ("picker", "picker-fd", "rr", "lr", "prefix", "oracle")  # oracle: shared rows
SIMPLE = ("rr", "lr", "prefix")  # the picker's defaults are compared with the best of these


# --- the replicas of one row ----------------------------------------------------------------------


class Replicas:
    """A row's simulators, kept across its columns: one process per slot count (at most 8 ports each)."""

    def __init__(self, pool: Pool, workload: Workload, workdir: Path) -> None:
        self.pool = pool
        self.stack = Stack(workdir, StackOptions(replicas=pool.size))  # its ports; no process of its own
        self.ports = self.stack.replica_ports
        self.procs: list[Proc] = []
        self.seen: dict[str, list[float]] = {"queries": [0.0] * pool.size, "hits": [0.0] * pool.size}
        by_slots: dict[int, list[int]] = {}
        for port, slots in zip(self.ports, pool.slots, strict=True):
            by_slots.setdefault(slots, []).append(port)
        try:
            for slots, ports in by_slots.items():
                for start in range(0, len(ports), PORTS_PER_SIM):
                    chunk = ports[start : start + PORTS_PER_SIM]
                    extra = [*SIM_BASE, "--max-num-seqs", str(slots), *workload.sim_args()]
                    name = f"sim-{len(self.procs)}"
                    proc = Proc(name, sim_argv(chunk, extra), workdir / f"{name}.log")
                    self.procs.append(proc)
                    for port in chunk:
                        proc.wait_ready(lambda p=port: health_ok(p))
        except BaseException:
            self.stop()
            raise

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    async def reset(self, client: httpx.AsyncClient, warming: bool) -> None:
        """Before a column: every engine idle, caches empty, speeds as the pool says (the restarting
        replica slow again when `warming`)."""
        for _ in range(200):  # at most ~20 s: streams the last column's gateway cut end at once
            if sum((await self.counters(client))["busy"]) == 0:
                break
            await asyncio.sleep(0.1)
        for index, address in enumerate(self.addresses):
            (await client.post(f"http://{address}/reset_prefix_cache")).raise_for_status()
            factor = self.pool.slowdown[index] * (
                WARM_FACTOR if warming and index == self.pool.warming else 1
            )
            await self.set_speed(client, index, factor)

    async def set_speed(self, client: httpx.AsyncClient, index: int, factor: float) -> None:
        url = f"http://{self.addresses[index]}/sim/speed"
        (await client.post(url, json={"slowdown": factor})).raise_for_status()

    async def counters(self, client: httpx.AsyncClient) -> dict[str, list[float]]:
        """Per replica: completed requests, prefix-cache queries and hits (tokens), running + waiting."""
        out: dict[str, list[float]] = {"served": [], "queries": [], "hits": [], "busy": []}
        names = {
            "served": ("vllm:request_success_total",),
            "queries": ("vllm:prefix_cache_queries_total",),
            "hits": ("vllm:prefix_cache_hits_total",),
            "busy": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
        }
        for address in self.addresses:
            page = parse_metrics((await client.get(f"http://{address}/metrics")).text)
            for key, wanted in names.items():
                out[key].append(sum(v for (n, _), v in page.items() if n in wanted))
        # the simulator reports its prefix-cache counters as 0 while its cache is empty (metrics.py:
        # `prefix.queries if prefix else 0`, and an empty PrefixCache is falsy), as it is right after
        # each column's reset: the counters only grow, so the highest value read is the true one
        for key in ("queries", "hits"):
            out[key] = self.seen[key] = [max(a, b) for a, b in zip(out[key], self.seen[key], strict=True)]
        return out

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


# --- one cell -------------------------------------------------------------------------------------


@dataclass
class Cell:
    stats: list[StreamStats] = field(default_factory=list)
    served: list[float] = field(default_factory=list)
    hit_rate: float = float("nan")
    cpu_per_1k: float | None = None
    engaged: bool | None = None  # affinity.latency auto at the end (picker columns)
    spread: float | None = None
    engaged_share: float | None = None  # of the 1 s samples during the run
    flips: int = 0
    error: str = ""

    def ok(self) -> list[StreamStats]:
        return [s for s in self.stats if s.done and s.status == 200 and s.arrivals]

    def ttft_ms(self, q: float) -> float:
        return percentile(sorted(s.arrivals[0] - s.started for s in self.ok()), q) * 1000

    def tpot_p90_ms(self) -> float:
        tpots = sorted(
            (s.arrivals[-1] - s.arrivals[0]) / (len(s.arrivals) - 1) for s in self.ok() if len(s.arrivals) > 1
        )
        return percentile(tpots, 90) * 1000


async def watch_engaged(client: httpx.AsyncClient, metrics_port: int, stop: asyncio.Event) -> list[bool]:
    """picker_latency_engaged once a second until `stop` (bounded by the run's own deadline)."""
    samples: list[bool] = []
    while not stop.is_set():
        with contextlib.suppress(httpx.HTTPError):
            page = parse_metrics((await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text)
            samples.append(page.get(("picker_latency_engaged", ()), 0.0) > 0)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    return samples


async def send_all(
    route: Callable[[str], int], requests: Sequence[tuple[float, str, int]], deadline_s: float
) -> list[StreamStats]:
    """Every request at its offset to the port `route` names for its prompt (a gateway's, or a
    replica's); those still open at `deadline_s` are cut and count as failed."""
    started = time.perf_counter()

    async def one(at: float, prompt: str, tokens: int) -> StreamStats:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        return await envoy_sender(route(prompt))(prompt, tokens)

    tasks = [asyncio.create_task(one(*r)) for r in requests]
    _, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return [
        t.result() if not t.cancelled() and t.exception() is None else StreamStats(error="deadline")
        for t in tasks
    ]


async def run_cell(
    replicas: Replicas, column: Column, plan: Plan, seconds: float, grace: float, workdir: Path
) -> Cell:
    cell = Cell()
    pool = replicas.pool
    async with httpx.AsyncClient(timeout=5) as client:
        await replicas.reset(client, warming=pool.warming is not None)
        options = StackOptions(
            replicas=pool.size,
            shape=column.shape,
            envoy_picker_tls=column.shape == "shipped",
            picker_env=dict(column.env) or None,
        )
        stack = Stack(workdir, options)
        stack.replica_ports = list(replicas.ports)  # the row's simulators, already running
        gateway: Proc | None = None
        stop_watch = asyncio.Event()
        watcher: asyncio.Task[list[bool]] | None = None
        try:
            route: Callable[[str], int]
            if column.oracle:
                route = oracle_route(pool, list(replicas.ports))
            elif column.picker:
                stack.start_picker()
                stack.start_envoy()
                route = functools.partial(_same, stack.listen_port)
            else:
                gateway, port = baseline_envoy(stack, workdir, column.lb_policy)
                route = functools.partial(_same, port)
            before = await replicas.counters(client)
            pid = stack.picker.pid if stack.picker is not None else None
            cpu_before = cpu_seconds(pid) if pid is not None else 0.0
            if pid is not None:
                watcher = asyncio.create_task(watch_engaged(client, stack.metrics_port, stop_watch))
            warm: asyncio.Task[None] | None = None
            if pool.warming is not None:

                async def recover(index: int = pool.warming) -> None:
                    await asyncio.sleep(WARM_SHARE * seconds)  # the scenario's schedule
                    await replicas.set_speed(client, index, pool.slowdown[index])

                warm = asyncio.create_task(recover())
            cell.stats = await send_all(route, plan.requests, seconds + grace)
            if warm is not None:
                await warm
            after = await replicas.counters(client)
            if pid is not None:
                cell.cpu_per_1k = (cpu_seconds(pid) - cpu_before) / max(1, len(plan.requests)) * 1000
                page = parse_metrics(
                    (await client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics")).text
                )
                cell.engaged = page.get(("picker_latency_engaged", ()), 0.0) > 0
                cell.spread = page.get(("picker_latency_spread", ()))
            cell.served = [b - a for a, b in zip(before["served"], after["served"], strict=True)]
            queries = sum(after["queries"]) - sum(before["queries"])
            hits = sum(after["hits"]) - sum(before["hits"])
            cell.hit_rate = hits / queries if queries else float("nan")
        finally:
            stop_watch.set()
            if watcher is not None:
                samples = await watcher
                cell.engaged_share = sum(samples) / len(samples) if samples else None
            if gateway is not None:
                gateway.stop()
            stack.stop()
            if stack.picker is not None:
                log = stack.picker.log_text()
                cell.flips = log.count("affinity.latency auto: engaged") + log.count(
                    "affinity.latency auto: released"
                )
    return cell


def _same(port: int, _prompt: str) -> int:
    return port


def pin_groups(pool: Pool, groups: int) -> list[int]:
    """The oracle's placement: group -> replica index, each group to the replica with the least
    groups per unit of capacity (slots / slowdown) that still has room in its cache for one more."""
    weight = [n / f for n, f in zip(pool.slots, pool.slowdown, strict=True)]
    held = [0] * pool.size
    out = []
    for _ in range(groups):
        room = [i for i in range(pool.size) if held[i] < CACHED_PROMPTS] or list(range(pool.size))
        best = min(room, key=lambda i: ((held[i] + 1) / weight[i], i))
        held[best] += 1
        out.append(best)
    return out


def oracle_route(pool: Pool, ports: Sequence[int]) -> Callable[[str], int]:
    """Each `shared` prompt straight to the replica its group is pinned to (`pin_groups`)."""
    pinned = pin_groups(pool, WORKLOADS["shared"].groups(pool))

    def route(prompt: str) -> int:
        group = group_of(prompt)
        if group is None:
            raise ValueError("the oracle routes `shared` prompts only")
        return ports[pinned[group]]

    return route


# --- the report -----------------------------------------------------------------------------------


def shares(cell: Cell, marks: Sequence[str]) -> str:
    total = sum(cell.served) or 1.0
    return "/".join(f"{100 * n / total:.0f}{m}" for n, m in zip(cell.served, marks, strict=True))


def auto_text(cell: Cell) -> str:
    if cell.engaged is None:
        return "-"
    share = "-" if cell.engaged_share is None else f"{100 * cell.engaged_share:.0f} %"
    spread = f", {cell.spread:.2f}x" if cell.spread else ""
    return f"{'engaged' if cell.engaged else 'off'}{spread}; {share} of run; {cell.flips} flips"


def cell_line(row: Row, name: str, cell: Cell) -> str:
    if cell.error:
        return f"| {row.name} | {name} | failed: {cell.error} |" + " |" * 7
    failed = len(cell.stats) - len(cell.ok())
    hit = "-" if math.isnan(cell.hit_rate) else f"{100 * cell.hit_rate:.1f}"
    cpu = "-" if cell.cpu_per_1k is None else f"{cell.cpu_per_1k:.2f}"
    ttft = f"{cell.ttft_ms(50):.0f} | {cell.ttft_ms(90):.0f} | {cell.tpot_p90_ms():.1f}"
    share = shares(cell, row.pool.marks())
    counts = f"{failed} of {len(cell.stats)}"
    return f"| {row.name} | {name} | {ttft} | {hit} | {share} | {counts} | {cpu} | {auto_text(cell)} |"


CELL_HEADER = (
    "| row | column | TTFT p50 ms | TTFT p90 ms | TPOT p90 ms | hit % | share % per replica | failed"
    " | picker CPU s / 1k req | affinity.latency auto |\n|---|---|---|---|---|---|---|---|---|---|"
)


def ratio(cells: dict[str, Cell], name: str) -> str:
    """`name`'s TTFT p90 over the best of rr / lr / prefix run in this row."""
    simple = [cells[c].ttft_ms(90) for c in SIMPLE if c in cells and not cells[c].error and cells[c].ok()]
    if name not in cells or cells[name].error or not cells[name].ok() or not simple:
        return "-"
    return f"{cells[name].ttft_ms(90) / min(simple):.2f}x"


def summary_line(
    row: Row, plan: Plan, load: float, cells: dict[str, Cell], names: Sequence[str], seconds: float
) -> str:
    p90 = [
        "-" if n not in cells or cells[n].error or not cells[n].ok() else f"{cells[n].ttft_ms(90):.0f}"
        for n in names
    ]
    picks = [ratio(cells, n) for n in ("picker", "picker-fd") if n in names]
    simple = [cells[c].ttft_ms(90) for c in SIMPLE if c in cells and not cells[c].error and cells[c].ok()]
    refs = []
    for reference in (plan.floor_ms, clairvoyant_ms(row, plan, seconds)):
        refs += [f"{reference:.0f}", f"{reference / min(simple):.2f}x" if simple else "-"]
    return (
        f"| {row.name} | {plan.rate:.1f} ({load:.2f} of {plan.capacity:.1f}) | "
        + " | ".join([*p90, *picks, *refs])
        + " |"
    )


def revision() -> str:
    """The commit the run measured, and whether the picker's tree differs from it."""

    def git(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=False)

    commit = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    dirty = git("status", "--porcelain", "--", "picker", "loadtest").stdout.strip()
    return commit + (" (with uncommitted changes in picker/ or loadtest/)" if dirty else "")


async def run(args: argparse.Namespace, rows: Sequence[Row], names: Sequence[str]) -> None:
    began = time.monotonic()
    print(f"bench_routing {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, commit {revision()}")
    print(
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; {args.seconds:g} s per cell at "
        f"{args.load:g} x capacity, seed {args.seed}; base replica: TTFT {TTFT_MS:g} ms + "
        f"{PREFILL_MS_PER_TOKEN:g} ms per uncached prompt token, {ITL_MS:g} ms a token, {SLOTS} slots"
    )
    print("shares: s = 2x slower, h = half the slots, r = the restarting replica (5x slower at first)\n")
    print(CELL_HEADER, flush=True)
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        for index, row in enumerate(rows):
            plan = make_plan(row, args.load, args.seconds, args.seed)
            folder = Path(tmp) / f"{index}"
            replicas = Replicas(row.pool, row.workload, folder / "sims")
            cells: dict[str, Cell] = {}
            try:
                for name in names:
                    if COLUMNS[name].oracle and row.workload.name != "shared":
                        continue  # no oracle without prompt groups
                    workdir = folder / name
                    workdir.mkdir(parents=True)
                    try:
                        cells[name] = await run_cell(
                            replicas, COLUMNS[name], plan, args.seconds, args.grace, workdir
                        )
                    except (RuntimeError, TimeoutError, OSError, httpx.HTTPError) as exc:
                        cells[name] = Cell(error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    print(cell_line(row, name, cells[name]), flush=True)
            finally:
                replicas.stop()
            summary.append(summary_line(row, plan, args.load, cells, names, args.seconds))
    picks = [f"{n} / best of rr, lr, prefix" for n in ("picker", "picker-fd") if n in names]
    print("\nTTFT p90 ms per column, and the picker's over the best simple policy:")
    floor = ["floor", "floor / best simple", "clairvoyant", "clairvoyant / best simple"]
    print("| row | rate req/s (load of capacity) | " + " | ".join([*names, *picks, *floor]) + " |")
    print("|---|---|" + "---|" * (len(names) + len(picks) + len(floor)))
    print("\n".join(summary))
    print(
        f"\n{len(rows)} rows x {len(names)} columns in {time.monotonic() - began:.0f} s; "
        f"load average at the end {os.getloadavg()[0]:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--rows", default=",".join(DEFAULT_ROWS), help="pool/workload,... ('list': all pairs)"
    )
    parser.add_argument(
        "--columns", default=",".join(DEFAULT_COLUMNS), help=f"comma list of: {', '.join(COLUMNS)}"
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each cell sends")
    parser.add_argument("--load", type=float, default=0.7, help="the rate as a share of the pool's capacity")
    parser.add_argument(
        "--grace", type=float, default=30.0, help="seconds after --seconds before a cell is cut"
    )
    parser.add_argument("--seed", type=int, default=63)
    args = parser.parse_args(argv)
    if args.rows == "list":
        print("\n".join(f"{p}/{w}" for p in POOLS for w in WORKLOADS))
        return 0
    try:
        rows = parse_rows(args.rows)
    except ValueError as exc:
        parser.error(str(exc))
    names = [n for n in args.columns.split(",") if n]
    unknown = [n for n in names if n not in COLUMNS]
    if unknown or not names or not rows:
        parser.error(f"unknown or no columns {unknown}; known: {', '.join(COLUMNS)}")
    if args.seconds <= 0 or args.load <= 0:
        parser.error("--seconds and --load must be above 0")
    import uvloop

    uvloop.run(run(args, rows, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
