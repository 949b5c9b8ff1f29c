"""Cache-aware routing against load-only and round robin, side by side in one run (issue 22).

Four simulated replicas where prefill dominates: each replica computes prompt tokens it has not
cached at `--prefill-tokens-per-s` (one prefill after another), caches blocks of 16 tokens in an LRU
of `--num-gpu-blocks`, and decodes at 5 ms a token. The same seeded Poisson arrivals go through:
  rr        round robin by the client, straight to the replicas (a Kubernetes Service)
  oracle    the client pins each prefix group (or conversation) to one replica: the best hit rate
  load      `picker proxy --prefix-affinity off`: load alone (this picker before issue 22)
  approx    `picker proxy` (default): approximate prefix affinity, learned from its own routing and
            corrected by the cached tokens each stream's usage reports (the replicas run as config/k8s
            deploys vLLM: --enable-prompt-tokens-details --enable-force-include-usage)
  approx0   the same without that correction (affinity.engine_feedback false), in (a)
  precise   `picker proxy --prefix-affinity precise`: the replicas' KV events and their /tokenize
  main      with --baseline PATH: the default configuration of the picker found there (an export of
            another revision), beside approx
The routing decisions are the picker's own core, the same in `picker serve` behind Envoy; the
proxy carries the bytes here so that two cores are left for the simulated engines and the client.
Workloads:
  a  32 groups of 4,000-token system prompts with short questions, at several offered loads
  b  multi-turn chats: every turn sends the whole conversation so far (chat completions)
  c  one hot group taking half of the traffic: how evenly the replicas run (max/mean running)
  d  decode-heavy: short unique prompts, 128 output tokens: no worse than load-only
  e  a rolling restart under (a): each replica drained through the picker's admin API, then back
     with an empty cache; failures, picks after a drain started, TTFT p99 before/during/after
Each measured phase: the prefix caches are emptied, a warm-up at the same rate, then the measured
window; every phase is bounded in requests and in time. Run: `python -m loadtest.bench_affinity`
(about 9 minutes; `--quick` for a 4-minute pass).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from loadtest.procs import Proc, free_port, port_open
from loadtest.stack import health_ok, parse_metrics, sim_argv
from loadtest.traffic import percentile

REPLICAS = 4
PREFILL_TOKENS_PER_S = 40_000.0  # a cold 4,000-token prompt: 100 ms of its replica's prefill
SIM_ARGS = (
    "--ttft-ms", "2", "--itl-ms", "5", "--max-num-seqs", "128",
    "--prefill-tokens-per-s", str(PREFILL_TOKENS_PER_S), "--block-size", "16",
    "--num-gpu-blocks", "3000",  # 48k tokens: 12 of the 32 system prompts per replica
    "--kv-capacity-tokens", "4000000", "--max-model-len", "64000",
    # as config/k8s deploys vLLM: each stream ends with its usage, with the prompt's cached tokens
    "--enable-prompt-tokens-details", "--enable-force-include-usage",
)  # fmt: skip
KV_OFFSET = 1000  # each replica publishes its KV events on its port + this
MODEL = "tiny-llama"


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    at: list[float] = field(default_factory=list)  # when each first token came (loop time)
    failed: int = 0
    tokens: int = 0
    seconds: float = 0.0
    hits: float = 0.0  # prefix cache hit rate, from the replicas' own counters
    skew: float = 0.0  # max / mean of each replica's time-averaged running requests

    def line(self, name: str) -> str:
        values = sorted(self.ttft)
        p50 = percentile(values, 50) * 1e3 if values else float("nan")
        p99 = percentile(values, 99) * 1e3 if values else float("nan")
        rate = self.tokens / self.seconds if self.seconds else 0.0
        return (
            f"  {name:<8} {len(values):>5} {self.failed:>4} {p50:>9.0f} {p99:>9.0f} "
            f"{rate:>9.0f} {self.hits * 100:>7.1f} {self.skew:>6.2f}"
        )


_COLUMNS = (("row", -8), ("ok", 5), ("fail", 4), ("TTFT p50", 9), ("TTFT p99", 9), ("tok/s", 9), ("hit %", 7))
HEADER = "  " + " ".join(f"{t:<{-w}}" if w < 0 else f"{t:>{w}}" for t, w in (*_COLUMNS, ("skew", 6)))


# --- workloads: each gives (request body, group) per arrival ---------------------------------------


def _words(rng: random.Random, count: int) -> str:
    return " ".join(f"w{rng.randrange(100_000)}" for _ in range(count))


class Groups:
    """(a) and (c): system prompts of about `tokens` tokens, each request a short new question."""

    def __init__(self, groups: int, tokens: int, seed: int, hot: float = 0.0, usage: bool = False) -> None:
        rng = random.Random(seed)
        self.usage = usage  # ask for usage in the stream (the engine's cached tokens correct the index)
        self.prompts = [f"System prompt of group {g}. " + _words(rng, tokens * 4 // 7) for g in range(groups)]
        self.hot = hot
        self.rng = random.Random(seed + 1)

    def next(self) -> tuple[dict[str, object], int]:
        rng = self.rng
        group = 0 if self.hot and rng.random() < self.hot else rng.randrange(len(self.prompts))
        prompt = self.prompts[group] + "\nQuestion: " + _words(rng, 28)
        body: dict[str, object] = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "stream": True}
        if self.usage:
            body["stream_options"] = {"include_usage": True}
        return body, group


class Conversations:
    """(b): chats whose every turn sends the conversation so far, then restarts after `turns`."""

    def __init__(self, count: int, seed: int, turns: int = 8) -> None:
        self.rng = random.Random(seed)
        self.turns = turns
        self.chats: list[list[dict[str, str]]] = [self._fresh(c) for c in range(count)]

    def _fresh(self, index: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": f"Assistant {index}. " + _words(self.rng, 1500)}]

    def next(self) -> tuple[dict[str, object], int]:
        index = self.rng.randrange(len(self.chats))
        chat = self.chats[index]
        if len(chat) > 2 * self.turns:
            chat = self.chats[index] = self._fresh(index)
        chat.append({"role": "user", "content": _words(self.rng, 60)})
        body = {"model": MODEL, "messages": list(chat), "max_tokens": 16, "stream": True}
        chat.append({"role": "assistant", "content": _words(self.rng, 40)})  # what the next turn quotes
        return body, index


class Unique:
    """(d): short prompts shared with nothing, long answers: decode dominates."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def next(self) -> tuple[dict[str, object], int]:
        return {"model": MODEL, "prompt": _words(self.rng, 60), "max_tokens": 128, "stream": True}, 0


# --- the client -----------------------------------------------------------------------------------


async def one(session: aiohttp.ClientSession, url: str, body: dict[str, object], out: Outcome) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    started = time.monotonic()
    try:
        async with session.post(url + path, json=body) as response:
            if response.status != 200:
                out.failed += 1
                await response.read()
                return
            first = None
            chunks = 0
            async for chunk in response.content.iter_any():
                if first is None:
                    first = time.monotonic() - started
                chunks += chunk.count(b"data: ")
            if first is not None:
                out.ttft.append(first)
                out.at.append(started + first)
                out.tokens += max(0, chunks - 1)
    except (aiohttp.ClientError, TimeoutError):
        out.failed += 1


async def running_skew(replicas: Sequence[str], stop: asyncio.Event) -> float:
    """Time-averaged running requests per replica, sampled every 100 ms: max / mean."""
    totals = [0.0] * len(replicas)
    samples = 0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            for index, replica in enumerate(replicas):
                async with session.get(f"http://{replica}/metrics") as response:
                    page = parse_metrics(await response.text())
                totals[index] += sum(v for (n, _), v in page.items() if n == "vllm:num_requests_running")
            samples += 1
            try:
                await asyncio.wait_for(stop.wait(), 0.1)
            except TimeoutError:
                pass
    mean = sum(totals) / len(totals) if samples else 0.0
    return max(totals) / mean if mean else 0.0


async def prefix_counters(replicas: Sequence[str]) -> tuple[float, float]:
    queries = hits = 0.0
    async with aiohttp.ClientSession() as session:
        for replica in replicas:
            async with session.get(f"http://{replica}/metrics") as response:
                page = parse_metrics(await response.text())
            queries += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_queries_total")
            hits += sum(v for (n, _), v in page.items() if n == "vllm:prefix_cache_hits_total")
    return queries, hits


async def reset_caches(replicas: Sequence[str]) -> None:
    async with aiohttp.ClientSession() as session:
        for replica in replicas:
            async with session.post(f"http://{replica}/reset_prefix_cache") as response:
                await response.read()


Route = Callable[[int], str]  # group -> base URL


async def rolling_restart(
    admin_url: str, replicas: Sequence[str], start_after_s: float, hold_s: float, marks: list[float]
) -> None:
    """Each replica in turn: drained through the picker's admin API, held, then back with an empty
    cache (a new pod), as a rolling update replaces replicas one after another."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(start_after_s)  # a schedule of the scenario, not a synchronisation
    async with aiohttp.ClientSession() as session:
        marks.append(loop.time())
        for replica in replicas:
            async with session.post(f"{admin_url}/admin/endpoints/{replica}/drain") as response:
                response.raise_for_status()
            await asyncio.sleep(hold_s)
            async with session.post(f"http://{replica}/reset_prefix_cache") as response:
                await response.read()
            async with session.post(f"{admin_url}/admin/endpoints/{replica}/undrain") as response:
                response.raise_for_status()
        marks.append(loop.time())


async def picks_after_drain_start(admin_url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/admin/drains") as response:
        drains = (await response.json())["drains"]
    return sum(int(d["picks_after_start"]) for d in drains)


async def phase(
    route: Route, workload: Groups | Conversations | Unique, rate: float, warmup_s: float, measure_s: float,
    replicas: Sequence[str], seed: int,
) -> Outcome:  # fmt: skip
    """Poisson arrivals at `rate`: a warm-up, then the measured window (bounded in time and count)."""
    await reset_caches(replicas)
    rng = random.Random(seed)
    out, warm = Outcome(), Outcome()
    tasks: set[asyncio.Task[None]] = set()
    stop = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        loop = asyncio.get_running_loop()
        start = loop.time()
        measure_from, end = start + warmup_s, start + warmup_s + measure_s
        skew: asyncio.Task[float] | None = None
        before = (0.0, 0.0)
        limit = int(rate * (warmup_s + measure_s) * 2) + 10
        issued = 0
        next_at = start
        while issued < limit:
            now = loop.time()
            if now >= end:
                break
            if skew is None and now >= measure_from:
                before = await prefix_counters(replicas)
                skew = asyncio.create_task(running_skew(replicas, stop))
            if next_at > now:
                await asyncio.sleep(next_at - now)
                continue
            body, group = workload.next()
            target = out if loop.time() >= measure_from else warm
            task = asyncio.create_task(one(session, route(group), body, target))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            issued += 1
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.wait(tasks, timeout=60)
        stop.set()
        out.skew = await skew if skew is not None else 0.0
    after = await prefix_counters(replicas)
    queries, hits = after[0] - before[0], after[1] - before[1]
    out.hits = hits / queries if queries else 0.0
    out.seconds = measure_s
    return out


async def auto_state(admin_url: str, stop: asyncio.Event) -> tuple[int, int, float]:
    """A uniform pool must leave `affinity.latency: auto` released: the picker's state every 0.5 s
    until `stop` (bounded: at most 600 samples): (samples engaged, samples, the widest spread)."""
    engaged = samples = 0
    widest = 0.0
    async with aiohttp.ClientSession() as session:
        while not stop.is_set() and samples < 600:
            async with session.get(f"{admin_url}/metrics") as response:
                page = parse_metrics(await response.text())
            engaged += page.get(("picker_latency_engaged", ()), 0.0) > 0
            widest = max(widest, page.get(("picker_latency_spread", ()), 0.0))
            samples += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)
    return engaged, samples, widest


# --- the setups -------------------------------------------------------------------------------------


def window_p99(out: Outcome, start: float, end: float) -> float:
    values = sorted(t for t, at in zip(out.ttft, out.at, strict=True) if start <= at < end)
    return percentile(values, 99) * 1e3 if values else float("nan")


def start_proxy(
    workdir: Path,
    name: str,
    replicas: Sequence[str],
    *extra: str,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[Proc, str]:
    port, metrics = free_port(), free_port()
    argv = [
        sys.executable, "-m", "picker", "proxy", "--bind-address", "127.0.0.1", "--port", str(port),
        "--metrics-port", str(metrics), "--endpoints", ",".join(replicas), "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    proc = Proc(f"proxy-{name}", argv, workdir / f"proxy-{name}.log", env=env, cwd=cwd)
    proc.wait_ready(lambda: "picker proxy ready" in proc.log_text() and port_open(port))
    ADMIN[f"http://127.0.0.1:{port}"] = f"http://127.0.0.1:{metrics}"
    return proc, f"http://127.0.0.1:{port}"


ADMIN: dict[str, str] = {}  # a proxy's URL -> its metrics/admin URL
ROLLOUT_HEADER = "  " + " ".join(
    f"{t:<{-w}}" if w < 0 else f"{t:>{w}}"
    for t, w in (
        ("row", -8), ("ok", 5), ("fail", 4), ("p99 before", 11), ("p99 during", 11), ("p99 after", 10),
        ("picks after drain start", 24),
    )
)  # fmt: skip


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as tmp:
        workdir = Path(tmp)
        ports = [free_port(KV_OFFSET) for _ in range(REPLICAS)]
        replicas = [f"127.0.0.1:{p}" for p in ports]
        sim_extra = [*SIM_ARGS, *(arg for p in ports for arg in ("--kv-events-port", str(p + KV_OFFSET)))]
        sims = Proc("sim", sim_argv(ports, sim_extra), workdir / "sim.log")
        proxies: dict[str, Proc] = {}
        try:
            for port in ports:
                sims.wait_ready(lambda p=port: health_ok(p))
            urls: dict[str, str] = {}
            for name, extra in (
                ("load", ("--prefix-affinity", "off")),
                ("approx", ()),
                ("precise", ("--prefix-affinity", "precise", "--kv-events-port-offset", str(KV_OFFSET))),
            ):
                proxies[name], urls[name] = start_proxy(workdir, name, replicas, *extra)
            # the approximate index without the engines' word on what they cached (no usage in streams)
            proxies["approx0"], urls["approx0"] = start_proxy(
                workdir, "approx0", replicas, env={"PICKER_AFFINITY__ENGINE_FEEDBACK": "false"}
            )
            if args.baseline:  # the default configuration of another picker (`-m picker` finds it there)
                proxies["main"], urls["main"] = start_proxy(
                    workdir, "main", replicas, cwd=Path(args.baseline)
                )
            main = ("main",) if args.baseline else ()
            turn = iter(range(10**9))
            routes: dict[str, Route] = {
                "rr": lambda group: f"http://{replicas[next(turn) % REPLICAS]}",
                "oracle": lambda group: f"http://{replicas[group % REPLICAS]}",
                **{name: (lambda group, url=url: url) for name, url in urls.items()},
            }
            warmup, measure = (2.0, 5.0) if args.quick else (3.0, 10.0)
            print(
                f"bench_affinity: {REPLICAS} simulated replicas, prefill {PREFILL_TOKENS_PER_S:.0f} tokens/s"
            )
            print(
                f"each phase: {warmup:.0f} s warm-up + {measure:.0f} s measured; same seeded arrivals per row"
            )
            levels = [15.0, 65.0] if args.quick else [15.0, 30.0, 65.0, 130.0]
            for rate in levels if "a" in args.only else ():
                print(f"\n(a) 32 groups x 4,000-token system prompts + short questions, {rate:.0f} req/s")
                print(HEADER)
                for name in ("rr", "oracle", "load", "approx0", *main, "approx", "precise"):
                    stop = asyncio.Event()
                    watch = (
                        asyncio.create_task(auto_state(ADMIN[urls[name]], stop)) if name == "approx" else None
                    )
                    outcome = await phase(
                        routes[name], Groups(32, 4000, seed=1), rate, warmup, measure, replicas, seed=2
                    )
                    print(outcome.line(name), flush=True)
                    if watch is not None:
                        stop.set()
                        engaged, samples, widest = await watch
                        state = f"engaged in {engaged} of {samples} samples, spread max {widest:.2f}"
                        print(f"  approx: latency auto {state}")
            print(
                "\n(b) multi-turn chats (24 conversations, up to 8 turns, the whole chat each turn), 20 req/s"
            )
            print(HEADER)
            for name in ("rr", "oracle", "load", *main, "approx", "precise") if "b" in args.only else ():
                outcome = await phase(
                    routes[name], Conversations(24, seed=3), 20.0, warmup, measure, replicas, 4
                )
                print(outcome.line(name), flush=True)
            print("\n(c) one hot group takes half the traffic (32 groups), 40 req/s: skew = max/mean running")
            print(HEADER)
            for name in ("rr", "oracle", "load", *main, "approx", "precise") if "c" in args.only else ():
                workload = Groups(32, 4000, seed=5, hot=0.5)
                # a longer window: running counts near 1 swing a lot from one sample to the next
                outcome = await phase(routes[name], workload, 40.0, warmup, measure * 1.5, replicas, seed=6)
                print(outcome.line(name), flush=True)
            hold = 2.0 if args.quick else 4.0
            print(
                f"\n(e) a rolling restart under (a), 30 req/s: each replica drained {hold:.0f} s, back empty"
            )
            print(ROLLOUT_HEADER)
            for name in ("load", *main, "approx", "precise") if "e" in args.only else ():
                url = urls[name]
                marks: list[float] = []
                rollout = asyncio.create_task(
                    rolling_restart(ADMIN[url], replicas, warmup + 3.0, hold, marks)
                )
                duration = 3.0 + REPLICAS * hold + 6.0
                outcome = await phase(
                    routes[name], Groups(32, 4000, seed=9), 30.0, warmup, duration, replicas, seed=10
                )
                await rollout
                begin, end = marks
                before = window_p99(outcome, begin - 3.0, begin)
                during = window_p99(outcome, begin, end)
                after = window_p99(outcome, end, end + 6.0)
                late = await picks_after_drain_start(ADMIN[url])
                print(
                    f"  {name:<8} {len(outcome.ttft):>5} {outcome.failed:>4} {before:>9.0f}ms "
                    f"{during:>9.0f}ms {after:>8.0f}ms {late:>24}",
                    flush=True,
                )
            print("\n(d) decode-heavy: unique 60-word prompts, 128 tokens out, 30 req/s")
            print(HEADER)
            for name in ("rr", "load", *main, "approx", "precise") if "d" in args.only else ():
                outcome = await phase(routes[name], Unique(seed=7), 30.0, warmup, measure, replicas, seed=8)
                print(outcome.line(name), flush=True)
        finally:
            for proc in proxies.values():
                proc.stop()
            sims.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases and two load levels")
    parser.add_argument("--only", default="abcde", help="the phases to run (default: all)")
    parser.add_argument(
        "--baseline",
        default="",
        help="a row `main`: the default configuration of the picker found at this path (an export of main)",
    )
    import uvloop

    uvloop.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
