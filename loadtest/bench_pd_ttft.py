"""Benchmark: TTFT of a prefill / decode pool (prefill x2 + decode x2, the simulator's P/D timing
`loadtest.rollout.pd.PD_SIM_ARGS`) through Envoy + the picker, beside a hand-wired oracle pairing on
the same seeded arrivals; then the prefill hop's worth by uncached prompt size.

1. The same arrivals (long unique prompts, so every request takes the hop) through Envoy + the picker
   and through the oracle: the client sends each request straight to a decode replica with
   `x-prefiller-host-port` set, bypassing Envoy and the picker; decode replica = the fewest streams
   open from the oracle's own counts, prefill replica = the fewest prefill steps outstanding (sent,
   no first token yet), ties in turn. TTFT p50 / p90 side by side, and the picker's spread of the
   prefill steps over the two prefill replicas (their request logs).
2. The hop's worth (`pd.prefill_min_tokens`): for each prompt size, the oracle with the hop and
   without it (the decode replica computes the prompt), idle (1 request/s) and under load.

Run: `python -m loadtest.bench_pd_ttft [--part 1|2]` (~2 min each part).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from loadtest import http_client
from loadtest.rollout.load import Arrival, LoadReport, poisson_arrivals
from loadtest.rollout.pd import PD_SIM_ARGS, PREFILLER, VERSION_LABEL, replay_to
from loadtest.rollout.report import failed
from loadtest.stack import Stack, StackOptions

ROLES = ("prefill", "prefill", "decode", "decode")
SIZES = (64, 256, 1024, 4096)
SHORT = 64  # below the default pd.prefill_min_tokens: no hop


# PD_SIM_ARGS's figures, for the oracle's own estimate of when a prompt would be ready
PREFILL_TOKENS_PER_S = 20000.0
STEP_S, PULL_S, PULL_PER_BLOCK_S, BLOCK = 0.020, 0.005, 0.0002, 16
HOPS = ("never", "always", "sooner")


def hop_cost_s(tokens: int) -> float:
    """What the hop adds to a prompt's TTFT by itself: the prefill step's own first-token step and
    the pull of its blocks."""
    return STEP_S + PULL_S + PULL_PER_BLOCK_S * -(-tokens // BLOCK)


class Oracle:
    """The hand-wired pairing: least-loaded decode and prefill replicas from its own counts. `hop`:
    never, always, or "sooner": only when the prompt would be ready sooner on the prefill replica
    (its backlog plus the hop's cost) than computed on the decode replica (its own backlog), for
    prompts of `tokens` tokens."""

    def __init__(self, prefills: list[str], decodes: list[str], hop: str = "always", tokens: int = 0) -> None:
        self.open = dict.fromkeys(decodes, 0)
        self.prefilling = dict.fromkeys(prefills, 0)  # hops sent, no first token yet
        self.computing = dict.fromkeys(decodes, 0)  # prompts computed in place, no first token yet
        self.hop, self.tokens = hop, tokens
        self._turns = {"decode": itertools.count(), "prefill": itertools.count()}
        self._chosen: dict[int, tuple[str, str]] = {}

    def _least(self, counts: dict[str, int], side: str) -> str:
        turn = next(self._turns[side])
        keys = list(counts)
        return min(keys, key=lambda a: (counts[a], (keys.index(a) - turn) % len(keys)))

    def _hops(self, decode: str, prefill: str) -> bool:
        if self.hop != "sooner":
            return self.hop == "always"
        per_prompt_s = self.tokens / PREFILL_TOKENS_PER_S
        in_place = (self.computing[decode] + 1) * per_prompt_s
        return (self.prefilling[prefill] + 1) * per_prompt_s + hop_cost_s(self.tokens) < in_place

    def target(self, index: int) -> tuple[str, dict[str, str]]:
        decode = self._least(self.open, "decode")
        self.open[decode] += 1
        prefill = self._least(self.prefilling, "prefill")
        if not self._hops(decode, prefill):
            self.computing[decode] += 1
            self._chosen[index] = (decode, "")
            return f"http://{decode}", {}
        self.prefilling[prefill] += 1
        self._chosen[index] = (decode, prefill)
        return f"http://{decode}", {PREFILLER: prefill}

    def first(self, index: int) -> None:
        decode, prefill = self._chosen[index]
        if prefill:
            self.prefilling[prefill] -= 1
        else:
            self.computing[decode] -= 1

    def done(self, index: int) -> None:
        self.open[self._chosen[index][0]] -= 1


def start_pool(workdir: Path, min_tokens: int) -> Stack:
    endpoints, config = workdir / "endpoints.yaml", workdir / "picker.yaml"
    config.write_text(
        json.dumps(
            {
                "pool": {"endpoints_file": str(endpoints), "endpoints_file_poll_s": 0.1},
                "pd": {"prefill_min_tokens": min_tokens},
            }
        )
    )
    decode = ("--role", "decode", "--pd-sidecar")
    options = StackOptions(
        replicas=len(ROLES),
        sim_args=PD_SIM_ARGS,
        picker_args=("--config", str(config)),
        static_endpoints=False,
        replica_args=(("--role", "prefill"), ("--role", "prefill"), decode, decode),
    )
    stack = Stack(workdir, options)
    entries = [
        {"address": a, "role": r, "labels": {VERSION_LABEL: "v1"}}
        for a, r in zip(stack.replicas, ROLES, strict=True)
    ]
    endpoints.write_text(json.dumps(entries))
    return stack.start()


def prefill_steps(prefills: list[str]) -> Counter[str]:
    """Prefill steps each prefill replica served (its request log), then the logs cleared."""
    steps: Counter[str] = Counter()
    for address in prefills:
        answer = http_client.get(f"http://{address}/sim/requests", timeout=5).json()
        records = answer["requests"] if isinstance(answer, dict) else answer
        steps[address] = sum(1 for r in records if r.get("remote_decode"))
        http_client.delete(f"http://{address}/sim/requests", timeout=5)
    return steps


async def through(
    target: Callable[[int], tuple[str, dict[str, str]]],
    arrivals: list[Arrival],
    tokens: int,
    salt: str,
    oracle: Oracle | None = None,
) -> LoadReport:
    return await replay_to(
        target,
        arrivals,
        tokens,
        salt=salt,
        first=oracle.first if oracle else None,
        done=oracle.done if oracle else None,
    )


def figures(load: LoadReport) -> str:
    lost = failed(load)
    return f"p50 {load.ttft_ms(50):5.0f} ms  p90 {load.ttft_ms(90):5.0f} ms" + (
        f"  ({lost} lost)" if lost else ""
    )


async def compare(stack: Stack, args: argparse.Namespace) -> None:
    """Interleaved rounds, oracle then picker, on the same arrivals: prompts of `prompt_tokens` (the
    hop taken), then prompts of `SHORT` tokens, below pd.prefill_min_tokens (no hop either way), which
    measures what the path through Envoy and the picker adds by itself."""
    prefills, decodes = stack.replicas[:2], stack.replicas[2:]
    arrivals = poisson_arrivals(args.rate, args.duration, (20, 80), args.seed)
    print(
        f"1. {len(arrivals)} streaming requests ({args.rate:g}/s Poisson for {args.duration:g} s, seed "
        f"{args.seed}), max_tokens 20-80; P x2 + D x2, {' '.join(PD_SIM_ARGS)}",
        flush=True,
    )
    prefill_steps(prefills)
    p90: dict[str, list[float]] = {}
    plan = [(f"{args.prompt_tokens}-token prompts", args.prompt_tokens, True)] * args.rounds
    plan.append((f"{SHORT}-token prompts", SHORT, False))
    for round_, (what, tokens, hop) in enumerate(plan):
        for name in ("oracle", "picker"):
            salt = f"{name} {round_}"
            if name == "oracle":
                oracle = Oracle(prefills, decodes, "always" if hop else "never")
                load = await through(oracle.target, arrivals, tokens, salt, oracle)
            else:
                load = await through(lambda _i: (stack.url, {}), arrivals, tokens, salt)
            spread = prefill_steps(prefills)
            p90.setdefault(f"{name} {what}", []).append(load.ttft_ms(90))
            print(
                f"   {what:<19} {name:<7} TTFT {figures(load)}  "
                f"prefill steps {[spread[p] for p in prefills]}",
                flush=True,
            )
    long_, short = f"{args.prompt_tokens}-token prompts", f"{SHORT}-token prompts"
    ratio = statistics.median(p90[f"picker {long_}"]) / statistics.median(p90[f"oracle {long_}"])
    path = statistics.median(p90[f"picker {short}"]) - statistics.median(p90[f"oracle {short}"])
    gap = statistics.median(p90[f"picker {long_}"]) - statistics.median(p90[f"oracle {long_}"])
    print(
        f"   TTFT p90 picker / oracle, {long_} (median of {args.rounds} rounds): {ratio:.2f}; "
        f"the gap {gap:.0f} ms, of which the path through Envoy and the picker without a hop: {path:.0f} ms"
    )


async def sweep(stack: Stack, args: argparse.Namespace) -> None:
    prefills, decodes = stack.replicas[:2], stack.replicas[2:]
    print(
        "\n2. the prefill hop's worth by uncached prompt size: the oracle never taking it (the decode "
        "replica computes the prompt), always, and only when the prompt would be ready sooner"
    )
    print(f"   {'prompt':>6}  {'load':<6} " + "".join(f"{h:<36}" for h in HOPS))
    for tokens in SIZES:
        for label, rate in (("2/s", 2.0), (f"{args.rate:g}/s", args.rate)):
            arrivals = poisson_arrivals(rate, args.sweep_duration, (20, 80), args.seed)
            cells = []
            for hop in HOPS:
                oracle = Oracle(prefills, decodes, hop, tokens)
                salt = f"sweep {tokens} {label} {hop}"
                load = await through(oracle.target, arrivals, tokens, salt, oracle)
                hops = sum(prefill_steps(prefills).values())
                cells.append(f"{figures(load)} ({hops} hops)" if hop == "sooner" else figures(load))
            print(f"   {tokens:>6}  {label:<6} " + "".join(f"{c:<36}" for c in cells), flush=True)


async def main_async(args: argparse.Namespace, workdir: Path) -> None:
    stack = await asyncio.to_thread(start_pool, workdir, args.min_tokens)
    try:
        if args.part in ("1", "both"):
            await compare(stack, args)
        if args.part in ("2", "both"):
            await sweep(stack, args)
    finally:
        await asyncio.to_thread(stack.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_pd_ttft", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds of arrivals, part 1")
    parser.add_argument(
        "--sweep-duration", type=float, default=5.0, help="seconds of arrivals, each sweep run"
    )
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="uncached prompt tokens, part 1")
    parser.add_argument("--min-tokens", type=int, default=256, help="the picker's pd.prefill_min_tokens")
    parser.add_argument("--seed", type=int, default=7, help="seed of the arrivals")
    parser.add_argument("--rounds", type=int, default=3, help="oracle / picker rounds, part 1")
    parser.add_argument("--part", choices=("1", "2", "both"), default="both", help="which part to run")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pd-ttft-") as tmp:
        asyncio.run(main_async(args, Path(tmp)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
