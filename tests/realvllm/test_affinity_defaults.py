"""Cache affinity with the picker's defaults on two real vLLM 0.32 engines (CPU build), through Envoy.

The plainest real pool: two equal engines (one core each), a small prefix cache (40 blocks of 128
tokens: about three of the six prompt groups fit in each), six groups of long shared prompts (a
short question each), 90 streamed requests two at a time, every engine's cache reset first. Perfect
affinity (each group always to the same engine, sent straight to it) sets the bar; the picker with
its defaults, behind the shipped Envoy config, must reach 95 % of its hit rate, by vLLM's own
counters. A real tokenizer counts about 2.5 tokens where the approximate index counts one, so the
index's picture of a 40-block cache is wrong unless it learns that; a uniform pool must not engage
`affinity.latency: auto` (whose predictions would pull groups off their engines).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import http_client
from loadtest.bench_realvllm_affinity import (
    KV_OFFSET,
    closed_loop,
    counters,
    prompts,
    reset_caches,
    vllm_pair_with_events,
)
from loadtest.realvllm import launcher
from loadtest.stack import Stack, StackOptions, parse_metrics

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(900)]

GROUPS, WORDS, REQUESTS, CONCURRENCY = 6, 300, 90, 2


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[launcher.RealVllm]]:
    workdir = tmp_path_factory.mktemp("realvllm-affinity")
    cores = ["0", "1"] if (os.cpu_count() or 1) >= 2 else ["0", "0"]
    ports = [launcher.free_port(KV_OFFSET), launcher.free_port(KV_OFFSET)]
    extra = ["--num-gpu-blocks-override", "40", "--max-model-len", "4096",
             "--enable-prompt-tokens-details", "--enable-force-include-usage"]  # fmt: skip
    with vllm_pair_with_events(workdir, cores, extra, ports) as servers:
        yield servers


def hit_rate(servers: list[launcher.RealVllm], urls: list[str]) -> float:
    """Reset both caches, send the seeded requests, and read the hit rate off vLLM's counters."""
    reset_caches(servers)
    texts = prompts(GROUPS, WORDS, seed=1)
    before = counters(servers)
    results = asyncio.run(closed_loop(urls, texts, CONCURRENCY, REQUESTS, seed=3))
    after = counters(servers)
    assert all(result is not None for result in results), "every request completed"
    queries, hits = after[0] - before[0], after[1] - before[1]
    assert queries > 0
    return hits / queries


def test_the_defaults_reach_perfect_affinitys_hit_rate(
    engines: list[launcher.RealVllm], tmp_path: Path
) -> None:
    perfect = hit_rate(engines, [server.url for server in engines])
    addresses = [f"127.0.0.1:{server.port}" for server in engines]
    options = StackOptions(replicas=0, extra_envoy_endpoints=addresses, picker_endpoints=addresses)
    stack = Stack(tmp_path / "stack", options)
    (tmp_path / "stack").mkdir()
    stack.start()
    try:
        picked = hit_rate(engines, [stack.url])
        metrics_port = stack.picker_ports[0][2]
        page = parse_metrics(http_client.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).text)
        log = stack.picker.log_text() if stack.picker is not None else ""
    finally:
        stack.stop()
    # on failure, what decided it: the spread `auto` read at the end and its switches
    spread = page.get(("picker_latency_spread", ()))
    switches = [line for line in log.splitlines() if "affinity.latency auto:" in line]
    seen = f"hit rate {picked:.3f} against perfect affinity's {perfect:.3f}; spread {spread}; {switches}"
    assert picked >= 0.95 * perfect, seen
    assert page[("picker_latency_engaged", ())] == 0.0 and "auto: engaged" not in log, seen  # uniform
