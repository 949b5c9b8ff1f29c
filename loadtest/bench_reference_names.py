"""Benchmark: what the reference picker's metric names cost a dispatched request, in-process.

The calls the request path makes for them (picker/observability/reference/): a request picked, its
output tokens, its end (duration, time per output token, request and response bytes, prompt tokens),
on one model, in rounds of `--count`; CPU us a request, median and range. Run it in each checkout to
compare (`git worktree add`, then `PYTHONPATH=<worktree> python -m loadtest.bench_reference_names`).
Bounded: `--rounds` x `--count` calls, a few seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from prometheus_client import CollectorRegistry

from picker.observability.metrics import Metrics


def per_request_us(rounds: int, count: int) -> list[float]:
    reference = Metrics(CollectorRegistry(), pool="bench").reference
    figures = []
    for _ in range(rounds):
        started = time.process_time()
        for _ in range(count):
            reference.picked("tiny-llama", 0)
            reference.produced("tiny-llama", 8)
            reference.ended(
                "tiny-llama",
                duration_s=0.4,
                request_bytes=900,
                response_bytes=2400,
                prompt_tokens=60,
                tpot_s=0.05,
            )
        figures.append((time.process_time() - started) * 1e6 / count)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--count", type=int, default=20000)
    args = parser.parse_args()
    us = per_request_us(args.rounds, args.count)
    print(f"reference names: {statistics.median(us):.2f} us a request (rounds {min(us):.2f}-{max(us):.2f})")


if __name__ == "__main__":
    main()
