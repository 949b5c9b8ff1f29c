"""`python -m loadtest.rollout`: a rolling update under streaming load, without and with the picker.

Runs the same seeded Poisson arrivals three times: (a) Envoy round robin with /health checks and
endpoint removal at SIGTERM, (b) Envoy + picker with terminating -> `picker drain-wait` -> SIGTERM,
(c) `picker proxy` with streams.resume, the same sequence, and one old replica SIGKILLed mid-rollout
(its streams continue elsewhere). Prints what the clients saw in each, the picker's scorecard of each
drain, and writes the timeline PNG.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

from loadtest.realvllm import launcher
from loadtest.rollout import report
from loadtest.rollout.load import Arrival, poisson_arrivals
from loadtest.rollout.rolling import REAL_VLLM_DEFAULTS, RolloutOptions, SetupRun, panels, run_setup
from loadtest.rollout.timeline import draw

DEFAULT_PNG = Path("rollout-timeline.png")


def _tokens(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        pair = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not MIN-MAX") from None
    if not 1 <= pair[0] <= pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return pair


def _wants_real_vllm(argv: list[str] | None) -> bool:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--real-vllm", action="store_true")
    return bool(pre.parse_known_args(argv)[0].real_vllm)


def build_parser(real_vllm: bool = False) -> argparse.ArgumentParser:
    """The options; with `real_vllm` their defaults are the small ones a 2-core machine can run."""
    d = RolloutOptions()
    if real_vllm:
        d = dataclasses.replace(d, **REAL_VLLM_DEFAULTS)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.rollout",
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--replicas", type=int, default=d.replicas, help="vLLM replicas")
    parser.add_argument("--rate", type=float, default=d.rate, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds of arrivals")
    parser.add_argument(
        "--max-tokens",
        type=_tokens,
        default=f"{d.tokens[0]}-{d.tokens[1]}",
        help="MIN-MAX, uniform per request",
    )
    parser.add_argument("--surge", type=int, default=d.surge, help="the Deployment's maxSurge")
    parser.add_argument("--unavailable", type=int, default=d.unavailable, help="its maxUnavailable")
    parser.add_argument("--source", choices=["file", "admin"], default=d.source, help="picker's endpoints")
    parser.add_argument("--rollout-at", type=float, default=d.rollout_at_s, help="rollout start (s)")
    parser.add_argument(
        "--propagation", type=float, default=d.propagation_s, help="endpoint change reaching the router (s)"
    )
    parser.add_argument(
        "--shutdown-timeout", type=float, default=d.shutdown_timeout_s, help="replicas' drain budget (s)"
    )
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the arrivals")
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG, help="where to write the timeline")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here, not in a temp dir")
    parser.add_argument(
        "--export-schedule",
        type=Path,
        help="also write the arrivals as an aiperf fixed-schedule JSONL (timestamp ms, output_length)",
    )
    parser.add_argument(
        "--real-vllm",
        action="store_true",
        help="roll real vLLM CPU servers (`make real-vllm`, the launcher's tiny model) instead of "
        "simulators; the defaults then become "
        + ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in REAL_VLLM_DEFAULTS.items()),
    )
    return parser


def export_schedule(arrivals: list[Arrival], path: Path) -> None:
    """The arrivals in aiperf's fixed-schedule (mooncake trace) JSONL, to replay them with aiperf."""
    lines = (
        json.dumps({"timestamp": round(a.at_s * 1000), "input_length": 4, "output_length": a.max_tokens})
        for a in arrivals
    )
    path.write_text("\n".join(lines) + "\n")


async def run(options: RolloutOptions, png: Path, workdir: Path) -> list[SetupRun]:
    arrivals = poisson_arrivals(options.rate, options.duration_s, options.tokens, options.seed)
    what = "real vLLM CPU" if options.real_vllm else "simulated vLLM"
    print(
        f"rolling update of {options.replicas} {what} replicas (maxSurge {options.surge}, "
        f"maxUnavailable {options.unavailable}) under {len(arrivals)} streaming requests "
        f"({options.rate:g}/s Poisson for {options.duration_s:g} s, max_tokens {options.tokens[0]}-"
        f"{options.tokens[1]}), run {'twice' if options.real_vllm else 'three times'} with the same arrivals"
    )
    runs = []
    kinds = ("round-robin", "picker") if options.real_vllm else ("round-robin", "picker", "proxy-resume")
    for index, kind in enumerate(kinds):
        print(f"\n({chr(ord('a') + index)}) {kind}: starting ...", flush=True)
        run_ = await run_setup(kind, options, arrivals, workdir / kind)
        print(f"    {report.verdict(run_)}")
        if run_.resumes is not None:
            print(f"    streams continued on another replica (picker_stream_resumes_total): {run_.resumes}")
        ended = options.rollout_at_s + run_.rollout_s
        if ended > options.duration_s:
            print(
                f"    note: the rollout ended {ended:.0f} s into the load, after its last arrival "
                f"({options.duration_s:g} s): later drains saw no traffic; raise --duration"
            )
        runs.append(run_)
    print("\nwhat the clients saw:\n")
    print(report.clients_table(runs))
    for index, run_ in enumerate(runs):
        print(f"\n({chr(ord('a') + index)}) drains, from the picker's GET /admin/drains (picker scorecard):")
        print(report.drains_table(run_))
    title = (
        f"Rolling update of {options.replicas} replicas under {options.rate:g} streaming requests/s: "
        "the same arrivals, without (top) and with (bottom) the picker"
    )
    if len(runs) == 3:
        title = title.replace(
            "without (top) and with (bottom) the picker",
            "without the picker (top), with it (middle),\nand through picker proxy with resume while one "
            "replica is SIGKILLed (bottom)",
        )
    caption = (
        "Each row is one vLLM replica process: its background colour is its state, the blue line the streams "
        "it is serving,\nmarkers are requests that failed at the client. The new replicas replace the old "
        "ones one by one (maxSurge 1)."
    )
    if options.real_vllm:
        title = title.replace(" replicas", " real vLLM CPU replicas", 1).replace("the same arrivals, ", "")
        caption = (
            "Each row is one vLLM server: its background colour is its state (a new vLLM starts in ~25 s "
            "idle, ~2 min under load), the blue line the requests in it\n(its own /metrics every 0.25 s), "
            "markers are requests that failed at the client (on the replica when Envoy's access log "
            "names it). "
            "The new replicas replace the old ones one by one (maxSurge 1)."
        )
    if options.surge != 1 or options.unavailable != 0:
        caption = caption.replace(
            "(maxSurge 1)", f"(maxSurge {options.surge}, maxUnavailable {options.unavailable})"
        )
    path = draw(panels(runs, [report.verdict(r) for r in runs]), png, title, caption)
    print(f"\ntimeline picture: {path.resolve()}")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_wants_real_vllm(argv))
    args = parser.parse_args(argv)
    if args.replicas < 1 or args.rate <= 0 or args.duration <= 0:
        parser.error("--replicas, --rate and --duration must be > 0")
    if args.surge < 0 or args.unavailable < 0 or args.surge + args.unavailable < 1:
        parser.error("--surge and --unavailable must be >= 0 and not both 0")
    if args.real_vllm and (reason := launcher.skip_reason()) is not None:
        print(f"--real-vllm: {reason}", file=sys.stderr)
        return 2
    options = RolloutOptions(
        replicas=args.replicas,
        rate=args.rate,
        duration_s=args.duration,
        tokens=args.max_tokens,
        surge=args.surge,
        unavailable=args.unavailable,
        source=args.source,
        rollout_at_s=args.rollout_at,
        propagation_s=args.propagation,
        shutdown_timeout_s=args.shutdown_timeout,
        seed=args.seed,
        real_vllm=args.real_vllm,
        model=launcher.SERVED_MODEL_NAME if args.real_vllm else RolloutOptions.model,
    )
    if args.export_schedule is not None:
        export_schedule(
            poisson_arrivals(args.rate, args.duration, args.max_tokens, args.seed), args.export_schedule
        )
    if args.workdir is not None:
        runs = asyncio.run(run(options, args.png, args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="rollout-") as tmp:
            runs = asyncio.run(run(options, args.png, Path(tmp)))
    return 0 if report.failed(runs[-1].load) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
