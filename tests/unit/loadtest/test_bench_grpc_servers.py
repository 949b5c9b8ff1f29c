"""The gRPC-stack benchmark's own parts: its Envoy config is one Envoy accepts, and the do-nothing
servers answer each routing message as the picker would (issue 15)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from loadtest.bench_grpc_servers import envoy_config
from loadtest.ext_proc_bare import AsyncService, answer
from picker.cli.envoyconf import envoy_binary
from picker.contract import headers
from tests.unit.extproc.test_extproc_service import BODY, body, request_headers, response_headers


@pytest.mark.parametrize(
    "ext_proc", [[], [9002], [9002, 9003]], ids=["envoy-alone", "with-ext-proc", "two-servers"]
)
def test_the_benchmarks_envoy_config_validates(tmp_path: Path, ext_proc: list[int]) -> None:
    config = tmp_path / "envoy.yaml"
    config.write_text(envoy_config(8080, 9901, 8000, ext_proc, tmp_path / "access.log"))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = config.read_text()
    assert ("ext_proc.v3.ExternalProcessor" in text) is bool(ext_proc)
    assert all(f"port_value: {port}" in text for port in ext_proc)


def test_the_bare_server_answers_like_the_picker_and_never_an_observer() -> None:
    assert answer(request_headers(), "10.0.0.1:8000").WhichOneof("response") == "request_headers"
    routed = answer(body(BODY), "10.0.0.1:8000")
    lb = routed.dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE].struct_value
    assert lb.fields[headers.DESTINATION].string_value == "10.0.0.1:8000"
    assert answer(response_headers(observer=True), "10.0.0.1:8000") is None


async def test_the_floor_server_ends_the_routing_stream_at_its_answer_as_the_picker_does() -> None:
    """bench_cost's floor: its routing stream ends at the body's answer, the replicas taken in turn."""

    async def feed(messages: list[object]) -> AsyncIterator[object]:
        for message in messages:
            yield message

    service = AsyncService("10.0.0.1:8000,10.0.0.2:8000", ends_at_answer=True)
    routing = [request_headers(), body(BODY), response_headers()]  # what would follow the answer
    first = [r async for r in service.Process(feed(routing), None)]
    assert [r.WhichOneof("response") for r in first] == ["request_headers", "request_body"]
    second = [r async for r in service.Process(feed(routing), None)]
    chosen = [
        r.dynamic_metadata.fields[headers.LB_METADATA_NAMESPACE].struct_value.fields[headers.DESTINATION]
        for r in (first[-1], second[-1])
    ]
    assert [v.string_value for v in chosen] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    observer = [response_headers(observer=True), response_headers(observer=True)]
    assert [r async for r in service.Process(feed(observer), None)] == []  # read to the end, no answer


@pytest.mark.parametrize("extra", [["--shipped"], []], ids=["shipped", "a-list"])
def test_the_stacks_without_the_shipped_shape_refuse_it(extra: list[str]) -> None:
    """Only the grpc.aio stacks serve --shipped and take a list of upstreams in turn: the others say so
    rather than route every request to the whole list."""
    upstream = "10.0.0.1:8000" if extra else "10.0.0.1:8000,10.0.0.2:8000"
    argv = [sys.executable, "-m", "loadtest.ext_proc_bare", "--stack", "grpclib", "--port", "0"]
    result = subprocess.run(
        [*argv, "--upstream", upstream, *extra], capture_output=True, text=True, timeout=20
    )
    assert result.returncode == 2 and "served by the grpc.aio stacks" in result.stderr, result.stderr
