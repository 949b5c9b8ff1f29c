"""A real vLLM prefill/decode pair on the CPU build, beside a simulator pair, both driven as vLLM's own
proxy example (toy_proxy_server.py) drives them.

The CPU build runs a pair with vLLM's ExampleConnector (kv_producer and kv_consumer sharing a folder:
the prefill writes each layer's KV as safetensors, the decode loads the prompt's full blocks from it).
That connector returns no kv_transfer_params (its request_finished is the base class's). What is compared
here: the shape of both answers, the decode's prompt tokens counted as external KV
(vllm:prompt_tokens_by_source), a plain request on a producer; and, from the installed vLLM's source, the
NixlConnector's fields and the defaults the simulator copies (lease, failure policy, transfer mode).
The NixlConnector itself runs on this build too, with PyPI's nixl-cu12 (UCX), but far too slowly for a
check (minutes to start, most of a minute for one pull): its answers are recorded in
tests/sim/data/nixl_pair_recorded.json and the simulator is compared with them in tests/sim.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_sim import SimConfig, run_sim
from vllm_sim.config import DisaggConfig, Role

from loadtest import http_client
from loadtest.realvllm import launcher
from tests.sim import pd_checks as pd

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

MODEL = launcher.SERVED_MODEL_NAME
DECODE_TOKENS = 8


def _connector(role: str, folder: Path) -> list[str]:
    config = {
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": str(folder)},
    }
    return ["--kv-transfer-config", json.dumps(config)]


@pytest.fixture(scope="module")
def real_pair(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[launcher.RealVllm, launcher.RealVllm, Path]]:
    """Two engines (a start: ~35 s each here), stopped by their PIDs on exit."""
    workdir = tmp_path_factory.mktemp("realvllm-pd")
    folder = workdir / "kv"
    folder.mkdir()
    with (
        launcher.real_vllm(
            launcher.free_port(), workdir / "p", extra_args=_connector("kv_producer", folder)
        ) as p,
        launcher.real_vllm(
            launcher.free_port(), workdir / "d", extra_args=_connector("kv_consumer", folder)
        ) as d,
    ):
        yield p, d, folder


def _external_tokens(metrics: str) -> float:
    match = re.search(
        r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)', metrics
    )
    assert match is not None, "no vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
    return float(match.group(1))


def _shape(body: dict[str, Any]) -> dict[str, Any]:
    """The fields a P/D proxy reads from an answer, connector-independent."""
    (choice,) = body["choices"]
    return {
        "object": body["object"],
        "finish_reason": choice["finish_reason"],
        "completion_tokens": body["usage"]["completion_tokens"],
        "has_kv_transfer_params": "kv_transfer_params" in body,
    }


async def test_a_real_pair_and_a_simulator_pair_answer_the_proxy_alike(
    real_pair: tuple[launcher.RealVllm, launcher.RealVllm, Path],
) -> None:
    p, d, folder = real_pair
    async with http_client.AsyncClient(timeout=60) as http:
        real = await pd.handoff(http, p.url, d.url, MODEL, DECODE_TOKENS)
        real_external = _external_tokens((await http.get(f"{d.url}/metrics")).text)
        plain = await http.post(f"{p.url}/v1/completions", json=pd.decode_body(MODEL, None, 3))
        async with run_sim(
            SimConfig(disagg=DisaggConfig()), ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]
        ) as (
            sp,
            sd,
        ):
            sim = await pd.handoff(http, sp.url, sd.url, MODEL, DECODE_TOKENS)
            sim_external = _external_tokens((await http.get(f"{sd.url}/metrics")).text)
            sim_plain = await http.post(f"{sp.url}/v1/completions", json=pd.decode_body(MODEL, None, 3))
    assert real.decode.status_code == sim.decode.status_code == 200, real.decode.text
    pd.check_prefill_shape(real.prefill.json())
    pd.check_decode_shape(real.decode.json(), DECODE_TOKENS)
    assert _shape(real.prefill.json()) == _shape(sim.prefill.json())
    assert _shape(real.decode.json()) == _shape(sim.decode.json())
    # the decode took the prompt's KV from the prefill instead of computing it, on both
    assert real_external > 0 and sim_external > 0
    assert any(folder.rglob("*.safetensors")), "the producer wrote no KV to the shared folder"
    # ExampleConnector: no params; the simulator returns the NixlConnector's (checked below)
    assert real.params is None and sim.params is not None
    # a plain request on a producer is served as on any engine
    assert plain.status_code == sim_plain.status_code == 200
    assert plain.json()["kv_transfer_params"] is None and sim_plain.json()["kv_transfer_params"] is None
    assert _shape(plain.json()) == _shape(sim_plain.json())


def _vllm_file(relative: str) -> Path:
    (site,) = (launcher.PROJECT_ROOT / ".venv-vllm" / "lib").glob("python*/site-packages")
    return site / "vllm" / relative


def _method(path: Path, cls: str, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not in {path}")


def test_the_simulator_returns_the_fields_of_the_installed_nixl_connector() -> None:
    nixl = "distributed/kv_transfer/kv_connector/v1/nixl/"
    finished = _method(
        _vllm_file(nixl + "pull_scheduler.py"), "NixlPullConnectorScheduler", "request_finished"
    )
    returned = [
        tuple(k.arg for k in call.keywords)
        for call in ast.walk(finished)
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "dict"
    ]
    assert returned == [pd.NIXL_PRODUCER_FIELDS]
    base = _vllm_file(nixl + "base_scheduler.py").read_text()
    assert '_TRANSFER_MODE: str = "pull"' in base
    assert re.search(r'"kv_lease_duration", (\d+)', base).group(1) == str(int(DisaggConfig().kv_lease_s))  # type: ignore[union-attr]
    scheduler = _vllm_file("v1/core/sched/scheduler.py").read_text()
    assert 'kv_transfer_params["remote_prefill_cached_tokens"]' in scheduler  # the last field of the answer
    transfer_config = _vllm_file("config/kv_transfer.py").read_text()
    policy = DisaggConfig().load_failure_policy.value
    assert f'kv_load_failure_policy: Literal["recompute", "fail"] = "{policy}"' in transfer_config


async def test_picker_proxy_runs_the_real_pair_through_both_steps(
    real_pair: tuple[launcher.RealVllm, launcher.RealVllm, Path], tmp_path: Path
) -> None:
    """`picker proxy` in front of the real pair (roles in its endpoints file): the prefill step on the
    producer, the decode on the consumer, which loads the prompt's KV instead of computing it. The
    ExampleConnector answers `kv_transfer_params: null`, so the decode goes as the client's request
    came: no recompute is counted, and no claim on the producer is left behind."""
    from loadtest.proxy_stack import ProxyStack
    from loadtest.stack import StackOptions

    p, d, _ = real_pair
    prefill, decode = p.url.removeprefix("http://"), d.url.removeprefix("http://")
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(
        json.dumps([{"address": prefill, "role": "prefill"}, {"address": decode, "role": "decode"}])
    )
    config = tmp_path / "picker.yaml"
    config.write_text(json.dumps({"pool": {"endpoints_file": str(endpoints)}}))
    options = StackOptions(replicas=0, static_endpoints=False, picker_args=("--config", str(config)))
    stack = ProxyStack(tmp_path, options).start()
    try:
        async with http_client.AsyncClient(timeout=120) as http:
            before = _external_tokens((await http.get(f"{d.url}/metrics")).text)
            prompt = "A proxy runs the prefill step on one engine and the decode on another. " * 30
            answer = await http.post(
                f"{stack.url}/v1/completions",
                json={"model": MODEL, "prompt": prompt, "max_tokens": DECODE_TOKENS, "ignore_eos": True},
            )
            after = _external_tokens((await http.get(f"{d.url}/metrics")).text)
            view = (await http.get(f"http://127.0.0.1:{stack.metrics_port}/admin/endpoints")).json()
        assert answer.status_code == 200, answer.text
        pd.check_decode_shape(answer.json(), DECODE_TOKENS)
        assert answer.headers.get("x-gateway-destination-endpoint-served") == decode
        assert after > before, "the decode computed the prompt instead of loading it"
        assert stack.picker_value("picker_pd_picks_total", how="pair") == 1
        recomputes = [
            v for (name, _), v in stack.picker_metrics().items() if name == "picker_pd_recomputes_total"
        ]
        assert sum(recomputes) == 0, recomputes
        assert all(e["kv_pulls_pending"] == 0 for e in view["endpoints"]), view
    finally:
        stack.stop()
