"""`python -m loadtest.scale_down` (`make scale-down`): scale-downs under streaming load, the ReplicaSet
controller choosing its victims by its own rule, then by the picker's pod-deletion-cost; the same
seeded arrivals both times, the figures side by side."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import tempfile
from pathlib import Path

from loadtest.scale_down import report
from loadtest.scale_down.picture import picture
from loadtest.scale_down.run import TIME_SCALE, Options, mixed_arrivals, run_arm


def build_parser() -> argparse.ArgumentParser:
    d = Options()
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.scale_down",
        description=(__doc__ or "").splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, default=d.replicas, help="the Deployment's replicas")
    parser.add_argument("--scale-to", type=int, default=d.scale_to, help="what the HPA scales it down to")
    parser.add_argument("--cycles", type=int, default=d.cycles, help="scale-downs (with a scale-up between)")
    parser.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    parser.add_argument("--long-share", type=float, default=d.long_share, help="share of long streams")
    parser.add_argument(
        "--eos-rate", type=float, default=d.eos_rate, help="share of requests that stop before max_tokens"
    )
    parser.add_argument(
        "--interval", type=float, default=d.interval_s, help="kube.deletion_cost_interval_s here"
    )
    parser.add_argument(
        "--steer", type=float, default=d.steer_s, help="scale_down.steer_s here (0: no steering)"
    )
    parser.add_argument("--grace", type=float, default=d.grace_s, help="terminationGracePeriodSeconds here")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the arrivals and the simulator")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here, not in a temp dir")
    parser.add_argument(
        "--png", type=Path, default=Path("scale-down-timeline.png"), help="where to draw the picture"
    )
    return parser


async def run(options: Options, workdir: Path, png: Path | None = None) -> list[report.ArmRun]:
    arrivals = mixed_arrivals(options)
    long = sum(1 for a in arrivals if a.max_tokens >= options.long_tokens[0])
    print(
        f"{options.cycles} scale-downs of a Deployment of {options.replicas} simulated vLLM replicas to "
        f"{options.scale_to} (and back up between them), under {len(arrivals)} streaming requests "
        f"({options.rate:g}/s Poisson, {long} long: {options.long_tokens[0] / 10:g}-"
        f"{options.long_tokens[1] / 10:g} s; the rest {options.short_tokens[0] / 10:g}-"
        f"{options.short_tokens[1] / 10:g} s; {options.eos_rate:.0%} stop before max_tokens), "
        f"grace {options.grace_s:g} s. Time is the issue's / {TIME_SCALE:g}: streams up to "
        f"{options.long_tokens[1] / 10 * TIME_SCALE:g} s, grace {options.grace_s * TIME_SCALE:g} s, "
        f"annotation interval {options.interval_s * TIME_SCALE:g} s.",
        flush=True,
    )
    print(
        f"\n(a) default and (b) picker-cost, side by side: running (~{options.duration_s + 25:.0f} s) ...",
        flush=True,
    )
    runs = list(
        await asyncio.gather(
            run_arm(False, options, arrivals, workdir / "default"),
            run_arm(True, options, arrivals, workdir / "picker-cost"),
        )
    )
    for index, arm in enumerate(runs):
        print(f"\n({chr(ord('a') + index)}) {arm.title}: each deletion")
        print(report.deletions_detail(arm, options.grace_s), flush=True)
    print("\n" + report.table(runs, options.interval_s, options.grace_s))
    print("\ngoals (issue 55):\n" + report.goals(runs[0], runs[1], options.interval_s))
    picker_run = runs[-1]
    print(
        "\n(b) the picker's own counters:",
        ", ".join(f"{k} {v:g}" for k, v in sorted(picker_run.picker_metrics.items())),
    )
    if png is not None:
        print(f"\nwrote {await asyncio.to_thread(picture, runs, options, png)}")
    return runs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.scale_to < args.replicas or args.cycles < 1 or args.rate <= 0:
        raise SystemExit("need 1 <= --scale-to < --replicas, --cycles >= 1, --rate > 0")
    options = dataclasses.replace(
        Options(),
        replicas=args.replicas,
        scale_to=args.scale_to,
        cycles=args.cycles,
        rate=args.rate,
        long_share=args.long_share,
        eos_rate=args.eos_rate,
        interval_s=args.interval,
        steer_s=args.steer,
        grace_s=args.grace,
        seed=args.seed,
    )
    if args.workdir is not None:
        asyncio.run(run(options, args.workdir, args.png))
    else:
        with tempfile.TemporaryDirectory(prefix="scale-down-") as tmp:
            asyncio.run(run(options, Path(tmp), args.png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
