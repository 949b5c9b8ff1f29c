"""Benchmark: a rollout of a prefill / decode pool under load (prefill x2 + decode x2, each replaced
by a v2 replica one at a time), run three times on the same seeded arrivals:

(a) Envoy + the picker, P/D pairs: roles and revision labels in the endpoints file; a replica leaves
    as a preStop drain makes it (draining in the file, stopped once the picker counts nothing in flight
    and no KV pull pending on it, or at the bound);
(b) Envoy alone: round robin over all four replicas, /health checks, removal at SIGTERM;
(c) Envoy + the picker, a flat pool: the same file without roles (no pairs; decode sidecars get no
    header and compute the prompt themselves), the same drains as (a).

Counts per column: requests lost, streams cut after their first token, pairs across revisions (each
decode replica's request log: the prefill replica it was told of vs its own revision), failed KV pulls
(the decode replicas' `kv_transfer.pulls_failed`), and TTFT. Writes the timeline picture.
`--kinds` picks columns, among them `pairs-engine-prestop` ((a) with the old replica stopped by
`picker drain-wait` on its engine's /metrics alone, no --pulls-url); `--pull-ms` and `--slots` make
pulls slower and decodes wait for a slot before they pull.
The simulator's P/D timing is `loadtest.rollout.pd.PD_SIM_ARGS`.

Run: `python -m loadtest.bench_rollout_pd [--rate 8 --duration 30 --prompt-tokens 1024]` (~2 min).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loadtest.rollout.load import Arrival, LoadReport, poisson_arrivals
from loadtest.rollout.pd import (
    PD_SIM_ARGS,
    PdFleet,
    PdPickerSetup,
    PdRoundRobinSetup,
    cut_after_first_token,
    drain_lines,
    read_rest,
    replay_to,
)
from loadtest.rollout.report import failed, side_by_side
from loadtest.rollout.rolling import roll
from loadtest.rollout.timeline import Panel, draw

KINDS = ("pairs", "round-robin", "flat")
MORE_KINDS = ("pairs-engine-prestop",)  # --kinds only: pairs stopped by drain-wait on the engine alone
PROPAGATION_S = 1.0
SHUTDOWN_TIMEOUT_S = 20.0
ROWS = (
    ("sent", "requests sent (the same seeded Poisson arrivals in every column)"),
    ("lost", "requests that did not complete (any error, any status but 200, cut)"),
    ("errors", "of them, by kind (http-<code>, truncated, conn-error, ...)"),
    ("cut", "streams cut after their first token"),
    ("pairs", "requests decoded with a prefill hop (decode logs naming a prefill replica)"),
    ("cross", "pairs across revisions (prefill replica of another revision than the decode's)"),
    ("pulls_failed", "KV pulls that failed (from a replica already gone, or blocks no longer held)"),
    ("on_prefill", "client requests a prefill-only replica served itself"),
    ("ttft_p50", "TTFT of completed streams, p50 (ms)"),
    ("ttft_p90", "TTFT of completed streams, p90 (ms)"),
    ("rollout_s", "time from the first replacement to the last old replica gone (s)"),
)


@dataclass
class Column:
    title: str
    load: LoadReport
    counts: dict[str, int]
    rollout_s: float
    panel: Panel
    drains: list[str]


async def run_kind(kind: str, arrivals: list[Arrival], args: argparse.Namespace, workdir: Path) -> Column:
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    sim_args = [*PD_SIM_ARGS, "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if args.pull_ms is not None:  # a slower link: every pull takes this long, whatever its size
        sim_args += ["--kv-transfer-ms", str(args.pull_ms), "--kv-transfer-per-block-ms", "0"]
    if args.slots is not None:  # fewer running slots: a decode may wait for one before its pull
        sim_args += ["--max-num-seqs", str(args.slots)]
    fleet = PdFleet(workdir, sim_args)
    grace_s = SHUTDOWN_TIMEOUT_S + 5
    setup: PdPickerSetup | PdRoundRobinSetup
    if kind == "round-robin":
        setup = PdRoundRobinSetup(workdir, fleet, propagation_s=PROPAGATION_S, grace_s=grace_s)
    else:
        setup = PdPickerSetup(
            workdir,
            fleet,
            roles=kind != "flat",
            propagation_s=PROPAGATION_S,
            grace_s=grace_s,
            engine_only=kind == "pairs-engine-prestop",
        )
    try:
        await asyncio.gather(*(fleet.start(a) for a in fleet.first))
        await setup.start()
        fleet.restart_clock()
        load = asyncio.create_task(
            replay_to(lambda _i: (setup.url, {}), arrivals, args.prompt_tokens, origin=fleet.origin)
        )
        await asyncio.sleep(args.rollout_at)  # the rollout starts into steady load
        began = time.monotonic()
        await asyncio.wait_for(roll(fleet, setup, 1, 0), 60 + len(fleet.first) * (grace_s + 10))
        rollout_s = time.monotonic() - began
        report = await load
        await read_rest(setup.books, fleet.replacements)
        counts = setup.books.counts(fleet.roles, fleet.revisions)
        events = [*fleet.events, *report.timeline_events()]
        panel = Panel(setup.title, events, "", fleet.lane_names())
        drains = await asyncio.to_thread(drain_lines, setup) if isinstance(setup, PdPickerSetup) else []
        return Column(setup.title, report, counts, rollout_s, panel, drains)
    finally:
        await asyncio.to_thread(setup.stop)
        await asyncio.to_thread(fleet.stop_all)


def column_view(column: Column) -> dict[str, str]:
    load = column.load
    kinds = {k: n for k, n in sorted(load.kinds().items()) if k != "completed"}
    return {
        "sent": str(len(load.outcomes)),
        "lost": str(failed(load)),
        "errors": ", ".join(f"{k}: {n}" for k, n in kinds.items()) or "-",
        "cut": str(cut_after_first_token(load)),
        **{key: str(column.counts[key]) for key in ("pairs", "cross", "pulls_failed", "on_prefill")},
        "ttft_p50": f"{load.ttft_ms(50):.0f}",
        "ttft_p90": f"{load.ttft_ms(90):.0f}",
        "rollout_s": f"{column.rollout_s:.1f}",
    }


async def main_async(args: argparse.Namespace, workdir: Path) -> list[Column]:
    arrivals = poisson_arrivals(args.rate, args.duration, (args.min_tokens, args.max_tokens), args.seed)
    print(
        f"rollout of a P/D pool (prefill x2 + decode x2, replaced one by one: P1, D1, P2, D2; maxSurge 1) "
        f"under {len(arrivals)} streaming requests ({args.rate:g}/s Poisson for {args.duration:g} s, "
        f"prompts of {args.prompt_tokens} uncached tokens, max_tokens {args.min_tokens}-{args.max_tokens}, "
        f"seed {args.seed}); simulator timing: {' '.join(PD_SIM_ARGS)}",
        flush=True,
    )
    columns = []
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    for index, kind in enumerate(kinds):
        print(f"({chr(ord('a') + index)}) {kind} ...", flush=True)
        columns.append(await run_kind(kind, arrivals, args, workdir / kind))
    print()
    print(side_by_side([c.title for c in columns], [column_view(c) for c in columns], ROWS, 12))
    for index, column in enumerate(columns):
        if column.drains:
            print(
                f"\n({chr(ord('a') + index)}) the old replicas' drains, from the picker's GET /admin/drains:"
            )
            print("\n".join(column.drains))
    if args.png is not None:
        title = (
            f"Rollout of a prefill / decode pool (P x2 + D x2) under {args.rate:g} streaming requests/s: "
            "the same arrivals\nthrough the picker's pairs (top), Envoy alone (middle), "
            "the picker on a flat pool (bottom)"
        )
        if len(columns) != len(KINDS) or args.kinds:
            title = title.split("\n")[0] + "\nthrough the setups named above each panel"
        caption = (
            "Each row is one replica (P prefill, D decode; v1 old, v2 new): its background colour is its "
            "state, the blue line the streams it is serving,\nmarkers are requests that failed at the "
            "client. "
            "Replaced one by one (maxSurge 1) in the order P1, D1, P2, D2."
        )
        path = draw([c.panel for c in columns], args.png, title, caption)
        print(f"\ntimeline picture: {path.resolve()}")
    return columns


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench_rollout_pd", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="uncached prompt tokens a request")
    parser.add_argument("--min-tokens", type=int, default=20, help="max_tokens, uniform from this")
    parser.add_argument("--max-tokens", type=int, default=80, help="max_tokens, uniform up to this")
    parser.add_argument("--rollout-at", type=float, default=3.0, help="rollout start (s into the load)")
    parser.add_argument("--seed", type=int, default=7, help="seed of the arrivals")
    parser.add_argument("--png", type=Path, default=Path("rollout-pd-timeline.png"), help="the picture")
    parser.add_argument("--workdir", type=Path, help="keep logs and configs here, not in a temp dir")
    parser.add_argument(
        "--kinds",
        help=f"comma-separated columns, of {', '.join(KINDS + MORE_KINDS)} (default: {','.join(KINDS)})",
    )
    parser.add_argument("--pull-ms", type=float, help="every KV pull takes this long (a slower link)")
    parser.add_argument("--slots", type=int, help="each replica's running slots (--max-num-seqs)")
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",") if args.kinds else ()) - set(KINDS + MORE_KINDS)
    if unknown:
        parser.error(f"--kinds: no such column {', '.join(sorted(unknown))}")
    if args.rate <= 0 or args.duration <= 0 or not 1 <= args.min_tokens <= args.max_tokens:
        parser.error("--rate and --duration must be > 0, 1 <= --min-tokens <= --max-tokens")
    if args.workdir is not None:
        columns = asyncio.run(main_async(args, args.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="rollout-pd-") as tmp:
            columns = asyncio.run(main_async(args, Path(tmp)))
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    pairs = [c for kind, c in zip(kinds, columns, strict=True) if kind == "pairs"]
    clean = all(
        failed(c.load) == 0 and c.counts["cross"] == 0 and c.counts["pulls_failed"] == 0 for c in pairs
    )
    return 0 if clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
