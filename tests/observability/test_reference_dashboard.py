"""The reference picker's Grafana dashboard (fixtures/reference_inference_gateway.json: Gateway API
Inference Extension, tools/dashboards/inference_gateway.json, Apache-2.0) against a running picker:
every metric a panel names that belongs to the endpoint picker is on /metrics, with the labels the query
groups by. The vLLM row (the model servers' own /metrics) and the Body Based Router row (another
component) are not the picker's to answer."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.stack import Stack, StackOptions
from loadtest.traffic import completion_body, stream_one

pytestmark = pytest.mark.envoy
DASHBOARD = Path(__file__).parent / "fixtures" / "reference_inference_gateway.json"
NOT_THE_PICKERS = ("vllm:", "bbr_")


def queries() -> list[str]:
    def walk(node: object) -> Iterator[str]:
        if isinstance(node, dict):
            for key, value in node.items():
                yield from [value] if key == "expr" and isinstance(value, str) else walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return [
        q
        for q in walk(json.loads(DASHBOARD.read_text()))
        if not q.lstrip("( ").startswith(NOT_THE_PICKERS) and not any(name in q for name in NOT_THE_PICKERS)
    ]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    stack = Stack(
        tmp_path_factory.mktemp("refdash"), StackOptions(replicas=2, sim_args=("--ttft-ms", "5"))
    ).start()
    try:

        async def traffic() -> None:
            async with httpx.AsyncClient(timeout=30) as client:
                for _ in range(4):
                    body = {**completion_body(max_tokens=8), "stream_options": {"include_usage": True}}
                    await stream_one(client, stack.url, body)
                await client.post(stack.url, content=b"not json")  # a refusal: error_total has a series

        asyncio.run(traffic())
        series = stack.picker_metrics()
    finally:
        stack.stop()
    labels: dict[str, set[str]] = {}
    for (name, pairs), _ in series.items():
        labels.setdefault(name, set()).update(k for k, _ in pairs)
    return labels


@pytest.mark.parametrize("query", queries())
def test_each_query_of_the_reference_dashboard_is_answered(page: dict[str, set[str]], query: str) -> None:
    names = set(re.findall(r"\binference_[a-z0-9_]+", query)) - {"inference_pool"}  # a label
    assert names
    for name in names:
        assert name in page, f"{name} is not on the picker's /metrics"
    for group in re.findall(r"by\s*\(([^)]*)\)", query):
        for label in (g.strip() for g in group.split(",")):
            if label in ("le", "pod", ""):  # le: histograms'; pod: the scrape's target label
                continue
            assert any(label in page[name] for name in names), f"{label} not on {names}"
