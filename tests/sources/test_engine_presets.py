"""Model servers other than vLLM: gauge-name presets, overrides, and metrics on another port or path."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from picker.config.model import ConfigError, LoadConfig
from picker.config.serve_flags import SERVE_FLAGS, add_serve_flags, overrides
from picker.config.sources import load_config
from picker.pool import Pool
from picker.sources.scraper import Scraper
from picker.sources.vllm_metrics import (
    SGLANG,
    VLLM,
    GaugeNames,
    GaugeScanner,
    MetricsPageError,
    gauge_names,
    parse_engine_gauges,
)
from tests.sources.test_scraper import GOOD as VLLM_PAGE

# The shape of SGLang's page (sglang --enable-metrics): one series per model, labelled model_name, next
# to look-alike gauges whose names start with the wanted ones.
SGLANG_PAGE = b"""# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP sglang:num_running_reqs_offline_batch The number of running low-priority offline batch requests.
# TYPE sglang:num_running_reqs_offline_batch gauge
sglang:num_running_reqs_offline_batch{model_name="meta-llama/Llama-3.1-8B-Instruct"} 99.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{model_name="meta-llama/Llama-3.1-8B-Instruct"} 123.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP sglang:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE sglang:time_to_first_token_seconds histogram
sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
"""


def test_vllm_preset_reads_a_vllm_page_and_not_an_sglang_one() -> None:
    gauges = parse_engine_gauges(VLLM_PAGE, names=VLLM)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (4.0, 2.0, 0.5)
    with pytest.raises(MetricsPageError, match="missing"):
        parse_engine_gauges(SGLANG_PAGE, names=VLLM)


def test_sglang_preset_reads_an_sglang_page_and_skips_look_alike_gauges() -> None:
    gauges = parse_engine_gauges(SGLANG_PAGE, names=SGLANG)
    assert (gauges.running, gauges.waiting, gauges.kv_usage) == (5.0, 3.0, 0.28)
    with pytest.raises(MetricsPageError, match="missing"):
        parse_engine_gauges(VLLM_PAGE, names=SGLANG)


def test_sglang_page_fed_a_few_bytes_at_a_time_gives_the_same_gauges() -> None:
    scanner = GaugeScanner(max_lines=256, names=SGLANG)
    for start in range(0, len(SGLANG_PAGE), 7):
        scanner.feed(SGLANG_PAGE[start : start + 7])
    assert scanner.result() == parse_engine_gauges(SGLANG_PAGE, names=SGLANG)


def test_overridden_gauge_names_replace_the_preset_ones() -> None:
    config = LoadConfig(engine="sglang", running_gauge="sglang:num_used_tokens")
    names = gauge_names(config)
    assert names == GaugeNames("sglang:num_used_tokens", SGLANG.waiting, SGLANG.kv_usage)
    assert parse_engine_gauges(SGLANG_PAGE, names=names).running == 123.0
    assert gauge_names(LoadConfig()) == VLLM


@pytest.mark.parametrize(
    "fields",
    [{"engine": "tgi"}, {"kv_gauge": "has space"}, {"metrics_path": "metrics"}, {"metrics_port": 0}],
)
def test_bad_load_settings_are_errors_naming_the_field(fields: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="load"):
        load_config(overrides={"load": fields})


def test_reference_picker_flags_reach_the_load_fields() -> None:
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(
        [
            "--model-server-engine",
            "sglang",
            "--model-server-metrics-port",
            "9090",
            "--model-server-metrics-path",
            "/stats/prometheus",
            "--model-server-metrics-scheme",
            "https",
            "--total-queued-requests-metric",
            "my:queue",
        ]
    )
    load = load_config(overrides=overrides(args, SERVE_FLAGS)).load
    assert (load.engine, load.metrics_port, load.metrics_path, load.metrics_scheme) == (
        "sglang",
        9090,
        "/stats/prometheus",
        "https",
    )
    assert gauge_names(load) == GaugeNames(SGLANG.running, "my:queue", SGLANG.kv_usage)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[str, Handler], Awaitable[int]]]:
    """Start in-process HTTP servers on free 127.0.0.1 ports; all stopped at the end."""
    runners: list[web.AppRunner] = []

    async def start(path: str, handler: Handler) -> int:
        app = web.Application()
        app.router.add_get(path, handler)
        runner = web.AppRunner(app)
        await runner.setup()
        runners.append(runner)
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        return int(runner.addresses[0][1])

    yield start
    for runner in runners:
        await runner.cleanup()


async def test_metrics_are_scraped_from_the_metrics_port_and_path_not_the_serving_port(
    serve: Callable[[str, Handler], Awaitable[int]],
) -> None:
    hits = {"serving": 0, "metrics": 0}

    async def serving_metrics(_: web.Request) -> web.Response:
        hits["serving"] += 1
        return web.Response(body=VLLM_PAGE)  # what a scrape of the wrong port would read

    async def sglang_metrics(_: web.Request) -> web.Response:
        hits["metrics"] += 1
        return web.Response(body=SGLANG_PAGE)

    serving_port = await serve("/metrics", serving_metrics)
    metrics_port = await serve("/stats/prometheus", sglang_metrics)
    address = f"127.0.0.1:{serving_port}"
    pool = Pool()
    pool.apply(ready=[address])
    config = LoadConfig(engine="sglang", metrics_port=metrics_port, metrics_path="/stats/prometheus")
    scraper = Scraper(pool, config, on_round=lambda: None)
    try:
        await scraper.scrape_round()
    finally:
        await scraper.close()
    endpoint = pool.get(address)
    assert endpoint is not None and endpoint.load is not None, "the scrape failed"
    assert (endpoint.load.running, endpoint.load.waiting, endpoint.load.kv_usage) == (5.0, 3.0, 0.28)
    assert hits == {"serving": 0, "metrics": 1}
