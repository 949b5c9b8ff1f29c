"""Two tenants on one saturated pool, with and without fair share by tokens (the fairness header).

Four simulated replicas of four slots each behind the real Envoy and `picker serve` (the shipped
shape), every request carrying `x-gateway-inference-fairness-id`. Seeded Poisson arrivals, bounded by
time and by count:
  light   short prompts (about 10 tokens), 20 output tokens, `--light-rate` requests/s
  heavy   about 8x the tokens a request (80 prompt tokens, 160 output tokens), 4x the light rate
Rows (`--rows`), each on a fresh stack:
  alone      the light tenant alone: the TTFT it gets from this pool when nobody competes
  off        both tenants, `flow.fair_share: off` (the queue takes turns between flows by request)
  on         both tenants, the default fair share (by tokens, equal weights)
  backlog    both tenants backlogged: the light one at `--backlog-x` times its rate (alone it would
             ask for more than half the pool), so each tenant's share of the tokens can be held
             against its weight (equal weights: half each)
  backlog-alone  the light tenant alone at that rate (its TTFT baseline for the backlog row)
Printed per row and tenant: requests sent / served / refused, TTFT p50 / p90 / p99, and each
tenant's share of the tokens dispatched (from the picker's own counters, none with fair share off)
between a quarter of the arrival window and its end, while both tenants are queued (not the
tail after arrivals stop, when the heavy tenant's backlog drains alone).

Run: `python -m loadtest.bench_tenants` (about 3 minutes; `--seconds` sets each row's window,
`--rows` which rows, `--backlog-x` the backlog row's light rate).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

from loadtest.stack import Stack, StackOptions, parse_metrics
from loadtest.traffic import percentile

FAIRNESS = "x-gateway-inference-fairness-id"
SIM = ("--max-num-seqs", "4", "--ttft-ms", "20", "--itl-ms", "10", "--tokens-per-chunk", "4")


@dataclass(frozen=True)
class Tenant:
    name: str
    prompt_chars: int  # the simulator counts a token per 4 characters
    max_tokens: int
    rate: float  # requests per second (Poisson)


@dataclass
class Seen:
    sent: int = 0
    ttft: list[float] = field(default_factory=list)
    refused: Counter[str] = field(default_factory=Counter)
    errors: int = 0


async def _one(
    session: aiohttp.ClientSession, url: str, tenant: Tenant, seen: Seen, rng: random.Random
) -> None:
    words = " ".join(f"w{rng.randrange(10_000):04d}" for _ in range(tenant.prompt_chars // 6 + 1))
    body = {
        "model": "tiny-llama",
        "prompt": words[: tenant.prompt_chars],
        "max_tokens": tenant.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.monotonic()
    try:
        async with session.post(
            url + "/v1/completions", json=body, headers={FAIRNESS: tenant.name}
        ) as response:
            if response.status != 200:
                await response.read()
                seen.refused[response.headers.get("x-picker-dropped-reason", str(response.status))] += 1
                return
            first = None
            async for _chunk in response.content.iter_any():
                if first is None:
                    first = time.monotonic()
                    seen.ttft.append(first - sent)
    except (aiohttp.ClientError, TimeoutError):
        seen.errors += 1


async def drive(
    url: str,
    tenants: Sequence[Tenant],
    seconds: float,
    seed: int,
    marks: Sequence[Callable[[], Awaitable[None]]] = (),
) -> dict[str, Seen]:
    """Open-loop arrivals for each tenant for `seconds` (at most rate x seconds x 1.5 requests each),
    then wait (bounded) for every stream to end. `marks`: awaited at a quarter of the window and at
    its end (the token counters read while arrivals go on)."""
    seen = {t.name: Seen() for t in tenants}
    tasks: set[asyncio.Task[None]] = set()
    timeout = aiohttp.ClientTimeout(total=seconds + 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def arrivals(index: int, tenant: Tenant) -> None:
            rng = random.Random(seed * 100 + index)
            cap = int(tenant.rate * seconds * 1.5) + 1
            start = time.monotonic()
            at = start
            while seen[tenant.name].sent < cap:
                at += rng.expovariate(tenant.rate)
                if at - start > seconds:
                    return
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                seen[tenant.name].sent += 1
                task = asyncio.create_task(_one(session, url, tenant, seen[tenant.name], rng))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

        async def marking() -> None:
            start = time.monotonic()
            for mark, at in zip(marks, (seconds / 4, seconds), strict=False):
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                await mark()

        await asyncio.gather(marking(), *(arrivals(i, t) for i, t in enumerate(tenants)))
        if tasks:
            await asyncio.wait(set(tasks), timeout=seconds + 60)
    return seen


def dispatched_tokens(metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """Tokens dispatched per tenant (the picker's picker_tenant_tokens_total, kind="dispatched";
    none with fair share off)."""
    out: dict[str, float] = {}
    for (name, labels), value in metrics.items():
        tags = dict(labels)
        if name == "picker_tenant_tokens_total" and tags.get("kind") == "dispatched":
            out[tags["tenant"]] = out.get(tags["tenant"], 0.0) + value
    return out


def ms(values: list[float], q: float) -> str:
    return f"{percentile(sorted(values), q) * 1e3:8.0f}" if values else "       -"


async def row(
    name: str, tenants: Sequence[Tenant], config: dict[str, object], seconds: float, seed: int
) -> None:
    with tempfile.TemporaryDirectory(prefix=f"bench-tenants-{name}-") as tmp:
        path = Path(tmp) / "picker.yaml"
        path.write_text(yaml.safe_dump(config))
        options = StackOptions(replicas=4, sim_args=SIM, picker_args=("--config", str(path)))
        stack = Stack(Path(tmp), options)
        stack.start()
        reads: list[dict[str, float]] = []

        async def mark() -> None:
            reads.append(dispatched_tokens(parse_metrics(await asyncio.to_thread(_metrics_text, stack))))

        try:
            seen = await drive(stack.url, tenants, seconds, seed, (mark, mark))
        finally:
            stack.stop()
    first, last = reads if len(reads) == 2 else ({}, {})
    tokens = {k: v - first.get(k, 0.0) for k, v in last.items()}
    total = sum(tokens.values())
    for tenant in tenants:
        s = seen[tenant.name]
        refused = ",".join(f"{k}:{v}" for k, v in sorted(s.refused.items())) or "0"
        share = f"{100 * tokens.get(tenant.name, 0.0) / total:5.1f} %" if total else "    -"
        print(
            f"{name:<6} | {tenant.name:<6} | {s.sent:>5} | {len(s.ttft):>6} | {refused:>14} | "
            f"{s.errors:>3} | {ms(s.ttft, 50)} | {ms(s.ttft, 90)} | {ms(s.ttft, 99)} | {share}",
            flush=True,
        )


def _metrics_text(stack: Stack) -> str:
    from loadtest import http_client

    return http_client.get(f"http://127.0.0.1:{stack.metrics_port}/metrics", timeout=5).text


ROWS = {
    "alone": ("light", {}),
    "off": ("both", {"tenants": {"fair_share": "off"}}),
    "on": ("both", {}),
    "backlog": ("both-backlogged", {}),
    "backlog-alone": ("light-backlogged", {}),
}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--light-rate", type=float, default=6.0)
    parser.add_argument("--rows", default="alone,off,on")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--backlog-x", type=float, default=10.0, help="the light rate's factor (backlog)")
    args = parser.parse_args()
    light = Tenant("light", 40, 20, args.light_rate)
    busy = Tenant("light", 40, 20, args.backlog_x * args.light_rate)
    heavy = Tenant("heavy", 320, 160, 4 * args.light_rate)
    print(
        f"4 replicas x 4 slots (simulated: TTFT 20 ms, 10 ms a token); light {light.rate:g}/s of ~10+20 "
        f"tokens, heavy {heavy.rate:g}/s of ~80+160 tokens; {args.seconds:g} s a row"
    )
    print(
        f"{'row':<6} | {'tenant':<6} | {'sent':>5} | {'served':>6} | {'refused':>14} | {'err':>3} | "
        f"{'TTFT p50':>8} | {'p90 ms':>8} | {'p99 ms':>8} | token share"
    )
    for name in args.rows.split(","):
        who, config = ROWS[name]
        own = busy if who.endswith("backlogged") else light
        tenants = (own,) if who.startswith("light") else (own, heavy)
        await row(name, tenants, config, args.seconds, args.seed)


if __name__ == "__main__":
    asyncio.run(main())
