"""Benchmark: what a canary adds to the picker's CPU per request (issue 24: at most 20 us).

In-process, the request path both frontends share: admit, pick, response headers, 8 body chunks
(an SSE stream with a first token), end. Side by side in one run: the same requests with no rollout,
and with a canary (8 endpoints, 2 of them the candidate, weight 25 %), its tick judged every 1,000
requests (every `rollout.tick_s` at run time) over a 1 s window (about 5,000 samples).
The median of 9 paired rounds of
10,000 requests each, CPU time (time.process_time).

CPU time on a shared VM swings by tens of us between rounds, so `--instructions` also counts
instructions under valgrind's callgrind (repeatable whatever else the machine does): each variant
at 1,000 and at 3,000 requests, the difference per request, so start-up cancels out.

Run: `python -m loadtest.bench_rollout [--instructions]` (about 50 s; 3 min more with it).
"""

from __future__ import annotations

import statistics
import time

from picker.config.model import RolloutConfig
from picker.observability.metrics import Metrics
from picker.pool import EndpointState, Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.rollout import Canary, CanaryPlan
from picker.scheduling import LoadPolicy
from picker.streams import EndReason

LABEL = "app.kubernetes.io/version"
REQUESTS = 10_000
ROUNDS = 9
CHUNKS = [b'data: {"choices":[{"text":"x","finish_reason":null}]}\n\n'] * 7 + [
    b'data: {"choices":[{"text":"","finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
]


def build(canary: bool) -> tuple[RequestPath, Pool]:
    pool = Pool()
    addresses = [f"10.0.0.{i}:8000" for i in range(1, 9)]
    labels = {a: {LABEL: "v2" if i < 2 else "v1"} for i, a in enumerate(addresses)}
    pool.reconcile({a: EndpointState.READY for a in addresses}, "bench", labels=labels)
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=2, load_policy=LoadPolicy(use_metrics=False)
    )
    if canary:
        settings = RolloutConfig(
            group_label=LABEL, candidate="v2", steps=(25, 100), step_interval_s=1e9, window_s=1
        )
        plan = CanaryPlan.of(settings)
        path.canary = Canary(plan, pool.now())
    return path, pool


def one_round(path: RequestPath, pool: Pool) -> float:
    request = InferenceRequest(method="POST", path="/v1/completions", model="m", body_bytes=100, stream=True)
    canary = path.canary
    started = time.process_time()
    for index in range(REQUESTS):
        ticket = path.admit(request)
        record = ticket.payload
        path.response_started(record, 200, record.picked[0])
        for chunk in CHUNKS:
            path.body_chunk(record, chunk)
        path.finish(record, EndReason.COMPLETED)
        if canary is not None and index % 1000 == 999:
            canary.tick(pool.now(), [])
    return (time.process_time() - started) / REQUESTS * 1e6


def main() -> None:
    built = {"no rollout": build(False), "canary 25 %": build(True)}
    for path, pool in built.values():
        one_round(path, pool)  # warm-up
    runs: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(ROUNDS):  # interleaved pairs: both see the same moment of the machine
        for name, (path, pool) in built.items():
            runs[name].append(one_round(path, pool))
    pairs = sorted(c - b for b, c in zip(runs["no rollout"], runs["canary 25 %"], strict=True))
    print(f"{'request path (admit, pick, 8 chunks, end)':<44} {'CPU per request, median':>24}")
    for name, values in runs.items():
        print(f"{name:<44} {statistics.median(values):>21.1f} us")
    print(
        f"{'the canary adds (median of paired rounds)':<44} {statistics.median(pairs):>21.1f} us"
        f"  (pairs from {pairs[0]:.1f} to {pairs[-1]:.1f})"
    )


def instructions(variant: str, requests: int) -> int:
    """Instructions callgrind counts for one process running `requests` of `variant`."""
    import re
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as workdir:
        out = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                f"--callgrind-out-file={workdir}/cg",
                sys.executable,
                "-m",
                "loadtest.bench_rollout",
                "--one",
                variant,
                str(requests),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            check=True,
        )
    found = re.search(r"Collected : (\d+)", out.stderr)
    assert found is not None, out.stderr[-500:]
    return int(found.group(1))


def count_instructions() -> None:
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(v, n) for v in ("base", "canary") for n in (1000, 3000)]
    with ThreadPoolExecutor(2) as pool:  # two cores: two valgrinds at a time
        counts = dict(zip(jobs, pool.map(lambda job: instructions(*job), jobs), strict=True))
    per = {v: (counts[(v, 3000)] - counts[(v, 1000)]) / 2000 for v in ("base", "canary")}
    print(
        f"instructions per request: no rollout {per['base']:,.0f}, canary {per['canary']:,.0f} "
        f"(+{per['canary'] - per['base']:,.0f}, +{100 * (per['canary'] / per['base'] - 1):.1f} %)"
    )


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--one"]:
        REQUESTS = int(sys.argv[3])
        one_round(*build(sys.argv[2] == "canary"))
    else:
        main()
        if "--instructions" in sys.argv:
            count_instructions()
