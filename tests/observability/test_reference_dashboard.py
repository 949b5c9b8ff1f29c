"""The reference picker's Grafana dashboard (fixtures/reference_inference_gateway.json: Gateway API
Inference Extension, tools/dashboards/inference_gateway.json, Apache-2.0) against a running picker:
every metric a panel names that belongs to the endpoint picker is on /metrics, with the labels the
query groups by, and (with promtool) every query evaluated over two scrapes gives samples. The vLLM
row (the model servers' own /metrics) and the Body Based Router row (another component) are not the
picker's to answer."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

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


Scrape = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def scrapes(tmp_path_factory: pytest.TempPathFactory) -> tuple[Scrape, Scrape]:
    """Two scrapes of a picker's /metrics, the same traffic before each (rates need two points)."""
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
        first = stack.picker_metrics()
        asyncio.run(traffic())
        second = stack.picker_metrics()
    finally:
        stack.stop()
    return first, second


@pytest.fixture(scope="module")
def page(scrapes: tuple[Scrape, Scrape]) -> dict[str, set[str]]:
    labels: dict[str, set[str]] = {}
    for (name, pairs), _ in scrapes[1].items():
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


def _series(key: tuple[str, tuple[tuple[str, str], ...]]) -> str:
    name, pairs = key
    quoted = (v.replace("\\", "\\\\").replace('"', '\\"') for _, v in pairs)
    return name + "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, quoted, strict=True)) + "}"


def test_each_query_evaluates_to_samples_over_two_scrapes(
    scrapes: tuple[Scrape, Scrape], tmp_path: Path
) -> None:
    """promtool evaluates every query (Grafana's intervals as one minute) over the two scrapes, 15 s
    apart: `absent(query)` must be empty, so each query gives at least one sample."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    first, second = scrapes
    inputs = []
    for key in sorted(set(first) | set(second)):
        if key[0].startswith(("inference_", "picker_output_tokens")):
            points = (s.get(key) for s in (first, second))
            values = " ".join("_" if v is None or v != v else repr(v) for v in points)
            inputs.append({"series": _series(key), "values": values})
    exprs = [q.replace("$__rate_interval", "1m").replace("$__range", "1m") for q in queries()]
    tests = [{"expr": f"absent({q})", "eval_time": "15s", "exp_samples": []} for q in exprs]
    # the series' step is the evaluation interval here (promtool 2.42 loads them at it)
    spec = {
        "evaluation_interval": "15s",
        "tests": [{"interval": "15s", "input_series": inputs, "promql_expr_test": tests}],
    }
    (tmp_path / "queries.test.yaml").write_text(yaml.safe_dump(spec, width=1000))
    done = subprocess.run(
        [promtool, "test", "rules", "queries.test.yaml"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
