"""The simulator's prefill/decode disaggregation (sim/vllm_sim/disagg.py): the hand-off between two
simulator processes, vLLM's kv_transfer_params fields, the transfer time in the decode's TTFT, a pull
that fails once the prefill is gone or its lease has ended."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest
from parity_checks import wait_until
from pd_checks import (
    NIXL_RESPONSE_FIELDS,
    PROMPT,
    check_decode_shape,
    check_prefill_shape,
    decode_body,
    handoff,
    prefill_body,
)
from simkit import fast_config, sim_requests, sse_frames
from vllm_sim import parse_fault_header, run_sim
from vllm_sim.config import DisaggConfig, KvLoadFailurePolicy, LatencyConfig, Role
from vllm_sim.prefix import completion_tokens

from loadtest import http_client
from loadtest.procs import free_port

MODEL = "tiny-llama"
BLOCK = 16  # the simulator's default block size
PROMPT_TOKENS = len(completion_tokens(PROMPT))
PROMPT_BLOCKS = -(-PROMPT_TOKENS // BLOCK)
# A real vLLM NixlConnector pair on the CPU build, recorded (the pair takes minutes to start and its
# pull took most of a minute here: too slow for a test run; how to rerun it: sim/README.md).
RECORDED = json.loads((Path(__file__).parent / "data" / "nixl_pair_recorded.json").read_text())


def pd_config(**disagg: Any) -> Any:
    return fast_config(disagg=DisaggConfig(**disagg))


async def state_of(http: http_client.AsyncClient, url: str) -> dict[str, Any]:
    response = await http.get(f"{url}/sim/state")
    assert response.status_code == 200
    return dict(response.json())


async def test_a_handoff_between_two_simulator_processes(sim_process: Any) -> None:
    prefill = sim_process("--port", "0", "--ttft-ms", "5", "--itl-ms", "5", "--role", "prefill",
                          "--kv-engine-id", "p-engine")  # fmt: skip
    decode = sim_process("--port", "0", "--ttft-ms", "5", "--itl-ms", "5", "--role", "decode",
                         "--kv-transfer-ms", "20")  # fmt: skip
    (p_url,), (d_url,) = prefill.urls, decode.urls
    async with http_client.AsyncClient(timeout=10) as http:
        done = await handoff(http, p_url, d_url, MODEL, max_tokens=6)
        check_prefill_shape(done.prefill.json(), PROMPT_TOKENS)
        params = done.params
        assert params is not None and tuple(params) == NIXL_RESPONSE_FIELDS
        host, _, port = prefill.addresses[0].rpartition(":")
        assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
        assert params["remote_engine_id"] == "p-engine"
        assert (params["remote_host"], params["remote_port"]) == (host, int(port))
        assert len(params["remote_block_ids"]) == 1 and len(params["remote_block_ids"][0]) == PROMPT_BLOCKS
        assert params["remote_num_tokens"] == PROMPT_TOKENS
        assert (params["tp_size"], params["transfer_mode"], params["remote_blocks_expiry_time"]) == (
            1,
            "pull",
            None,
        )
        assert isinstance(params["remote_request_id"], str)
        assert done.decode.status_code == 200, done.decode.text
        check_decode_shape(done.decode.json(), 6)
        p_state, d_state = await state_of(http, p_url), await state_of(http, d_url)
    assert p_state["kv_transfer"]["role"] == "prefill" and d_state["kv_transfer"]["role"] == "decode"
    assert p_state["kv_transfer"]["pulled"] == 1 and p_state["kv_transfer"]["held_requests"] == 0
    assert p_state["tokens_held"] == 0  # the pulled blocks are free again
    assert d_state["kv_transfer"]["pulls_failed"] == 0


async def test_a_prefill_holds_its_blocks_in_its_kv_usage_until_pulled() -> None:
    async with run_sim(pd_config(), ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            first = await http.post(f"{p.url}/v1/completions", json=prefill_body(MODEL))
            held = (await state_of(http, p.url))["kv_transfer"]
            assert held["held_requests"] == 1 and held["held_tokens"] == PROMPT_TOKENS
            assert p.state.engine.tokens_held == PROMPT_TOKENS and p.state.engine.kv_usage > 0
            params = first.json()["kv_transfer_params"]
            second = await http.post(f"{d.url}/v1/completions", json=decode_body(MODEL, params, 3))
            assert second.status_code == 200
            assert p.state.engine.tokens_held == 0
            # vLLM's vllm:prompt_tokens_by_source: the decode computed none of the prompt
            metrics = (await http.get(f"{d.url}/metrics")).text
            assert f'source="external_kv_transfer"}} {float(PROMPT_TOKENS)}' in metrics
            assert 'source="local_compute"} 0.0' in metrics
            # the same params again: the blocks were pulled once and are gone
            again = await http.post(f"{d.url}/v1/completions", json=decode_body(MODEL, params, 3))
            assert again.status_code == 500


async def test_the_transfer_time_shapes_the_decode_ttft_and_its_cache_hits_shorten_it() -> None:
    per_block_ms, per_prompt_token_ms = 40.0, 5.0
    latency = LatencyConfig(ttft_ms=5.0, itl_ms=5.0, ttft_per_prompt_token_ms=per_prompt_token_ms)
    config = dataclasses.replace(
        pd_config(transfer_ms=10.0, transfer_per_block_ms=per_block_ms), latency=latency
    )
    async with run_sim(config, ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            ttfts = []
            for n in range(2):  # the second decode of the same prompt finds it in its own cache
                await handoff(http, p.url, d.url, MODEL, max_tokens=2)
                (record,) = [r for r in await sim_requests(d.url) if r["outcome"] == "completed"][n : n + 1]
                ttfts.append(record["first_token_at"] - record["arrival"])
    pull_s = (10.0 + per_block_ms * PROMPT_BLOCKS) / 1000
    assert ttfts[0] >= pull_s  # the pull comes first...
    # ...and replaces the prefill: no per-prompt-token compute (5 ms x the prompt, > 1 s) on top
    assert ttfts[0] < pull_s + PROMPT_TOKENS * per_prompt_token_ms / 1000
    # the second pulls the last, partial block only: shorter by most of the other blocks' time
    assert ttfts[1] < ttfts[0] - per_block_ms * (PROMPT_BLOCKS - 1) / 2 / 1000


@pytest.mark.parametrize("stream", [False, True])
async def test_the_pull_fails_when_the_prefill_process_is_gone(sim_process: Any, stream: bool) -> None:
    prefill = sim_process("--port", "0", "--ttft-ms", "5", "--role", "prefill")
    decode = sim_process("--port", "0", "--ttft-ms", "5", "--role", "decode")
    async with http_client.AsyncClient(timeout=10) as http:
        first = await http.post(f"{prefill.urls[0]}/v1/completions", json=prefill_body(MODEL))
        params = first.json()["kv_transfer_params"]
        prefill.stop()  # by its PID; the pull finds the port closed (connection refused)
        body = {**decode_body(MODEL, params, 4), "stream": stream}
        second = await http.post(f"{decode.urls[0]}/v1/completions", json=body)
        state = await state_of(http, decode.urls[0])
    error = {"message": "Internal server error", "type": "InternalServerError", "param": None, "code": 500}
    if stream:  # the 200 and its headers went out at admission: the error comes in the stream
        assert second.status_code == 200
        assert sse_frames(second.text) == [{"error": error}] and second.text.endswith("data: [DONE]\n\n")
    else:
        assert second.status_code == 500 and second.json() == {"error": error}
    assert state["kv_transfer"]["pulls_failed"] == 1
    (record,) = await sim_requests(decode.urls[0])
    assert record["outcome"] == "kv-load-failed"


async def test_with_the_recompute_policy_a_failed_pull_is_a_local_prefill() -> None:
    config = pd_config(load_failure_policy=KvLoadFailurePolicy.RECOMPUTE)
    async with run_sim(config, ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            first = await http.post(f"{p.url}/v1/completions", json=prefill_body(MODEL))
            await p.stop()
            second = await http.post(
                f"{d.url}/v1/completions", json=decode_body(MODEL, first.json()["kv_transfer_params"], 4)
            )
    assert second.status_code == 200
    check_decode_shape(second.json(), 4)
    assert d.state.kv.pulls_failed == 1


async def test_blocks_never_pulled_are_freed_when_the_lease_ends() -> None:
    async with run_sim(pd_config(kv_lease_s=0.3), ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            first = await http.post(f"{p.url}/v1/completions", json=prefill_body(MODEL))
            assert p.state.engine.tokens_held == PROMPT_TOKENS
            assert await wait_until(lambda: p.state.kv.expired == 1, within_s=5)
            assert p.state.engine.tokens_held == 0
            assert (await state_of(http, p.url))["kv_transfer"]["held_requests"] == 0
            late = await http.post(
                f"{d.url}/v1/completions", json=decode_body(MODEL, first.json()["kv_transfer_params"], 2)
            )
    assert late.status_code == 500  # the prefill answers the pull 404: the blocks are gone


async def test_a_stopped_prefill_mid_transfer_fails_the_pull() -> None:
    config = pd_config(transfer_ms=8000.0)  # longer than the stop's grace for handlers
    async with run_sim(config, ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            first = await http.post(f"{p.url}/v1/completions", json=prefill_body(MODEL))
            params = first.json()["kv_transfer_params"]
            task = asyncio.ensure_future(
                http.post(f"{d.url}/v1/completions", json=decode_body(MODEL, params, 2))
            )
            assert await wait_until(lambda: p.state.kv.snapshot()["pulling"] == 1, within_s=5)
            await p.stop()
            second = await asyncio.wait_for(task, 10)
    assert second.status_code == 500


async def test_plain_requests_on_a_prefill_replica_are_served_as_ever() -> None:
    async with run_sim(pd_config(), roles=[Role.PREFILL]) as (p,):
        async with http_client.AsyncClient(base_url=p.url, timeout=10) as http:
            plain = await http.post(
                "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
            )
            assert plain.status_code == 200 and plain.json()["kv_transfer_params"] is None
            assert plain.json()["usage"]["completion_tokens"] == 4
            assert p.state.kv.snapshot()["held_requests"] == 0
            # a streamed prefill holds its blocks but, as vLLM, carries no params in the stream
            streamed = await http.post("/v1/completions", json={**prefill_body(MODEL), "stream": True})
            assert streamed.status_code == 200 and "kv_transfer_params" not in streamed.text
            assert p.state.kv.snapshot()["held_requests"] == 1
            # params it cannot use (no remote_*) are ignored: a local prefill
            odd = await http.post(
                "/v1/completions", json={**decode_body(MODEL, {"do_remote_prefill": True}, 2)}
            )
            assert odd.status_code == 200
            bad = await http.post(
                "/v1/completions", json={**decode_body(MODEL, None, 2), "kv_transfer_params": [1]}
            )
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params"
            state = (await http.get("/sim/state")).json()["kv_transfer"]
    assert state["role"] == "prefill" and state["held_requests"] == 1


async def test_a_replica_is_both_by_default_with_its_own_engine_id() -> None:
    async with run_sim(fast_config(), ports=[0, 0]) as (a, b):
        assert a.state.kv.role is Role.BOTH
        assert a.state.kv.engine_id != b.state.kv.engine_id


async def test_the_pull_endpoint_refuses_bad_input_clearly() -> None:
    async with run_sim(pd_config()) as (p,):
        async with http_client.AsyncClient(base_url=p.url, timeout=10) as http:
            not_json = await http.post("/sim/kv/pull", content=b"{")
            no_ids = await http.post("/sim/kv/pull", json={"remote_request_id": 3})
            negative = await http.post(
                "/sim/kv/pull", json={"remote_engine_id": "e", "remote_request_id": "r", "transfer_ms": -1}
            )
            unknown = await http.post(
                "/sim/kv/pull", json={"remote_engine_id": "e", "remote_request_id": "r"}
            )
    assert [r.status_code for r in (not_json, no_ids, negative, unknown)] == [400, 400, 400, 404]


async def test_the_hand_off_matches_a_recorded_real_nixl_pair_field_by_field() -> None:
    real_params = RECORDED["prefill_response"]["kv_transfer_params"]
    config = dataclasses.replace(
        pd_config(), cache=dataclasses.replace(fast_config().cache, prompt_tokens_details=True)
    )
    async with run_sim(config, ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            done = await handoff(http, p.url, d.url, MODEL, max_tokens=8)
            body = {**decode_body(MODEL, None, 4, prompt="Another prompt. " * 30), "stream": True}
            first = await http.post(
                f"{p.url}/v1/completions", json=prefill_body(MODEL, prompt=body["prompt"])
            )
            await p.stop()
            body["kv_transfer_params"] = first.json()["kv_transfer_params"]
            failed = await http.post(f"{d.url}/v1/completions", json={**body, "stream": False})
            failed_stream = await http.post(f"{d.url}/v1/completions", json=body)
    params = done.params
    assert params is not None and list(params) == list(real_params)  # the same fields, in the same order
    for name, real in real_params.items():
        assert type(params[name]) is type(real), name
    for name in ("do_remote_prefill", "do_remote_decode", "tp_size", "dcp_size", "pp_size",
                 "remote_blocks_expiry_time", "transfer_mode", "remote_prefill_cached_tokens"):  # fmt: skip
        assert params[name] == real_params[name], name
    # ids as vLLM's: one list per KV-cache group, from 1 (block 0 is its null block), one per block
    assert all(isinstance(b, int) and b >= 1 for b in params["remote_block_ids"][0])
    real_prompt = RECORDED["prefill_response"]["usage"]["prompt_tokens"]
    assert len(real_params["remote_block_ids"][0]) == -(-real_prompt // 128)  # vLLM CPU's block: 128
    assert real_params["remote_num_tokens"] == real_prompt and params["remote_num_tokens"] == PROMPT_TOKENS
    id_shape = r"cmpl-[0-9a-f]+-0-[0-9a-f]{8}"
    assert re.fullmatch(id_shape, real_params["remote_request_id"]) and re.fullmatch(
        id_shape, params["remote_request_id"]
    )
    # both answers: the shape the proxy reads
    for name in ("prefill_response", "decode_response"):
        real_body, sim_body = (
            RECORDED[name],
            (done.prefill if name == "prefill_response" else done.decode).json(),
        )
        assert [c["finish_reason"] for c in sim_body["choices"]] == [
            c["finish_reason"] for c in real_body["choices"]
        ]
        assert sim_body["usage"]["completion_tokens"] == real_body["usage"]["completion_tokens"]
        assert set(sim_body) - {"kv_transfer_params"} <= set(real_body)
    assert done.decode.json()["kv_transfer_params"] is None
    # the decode reports the prefill's cache hits, not the tokens it pulled
    assert done.decode.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # a failed pull (the prefill stopped), byte for byte
    assert failed.status_code == RECORDED["failed_pull_response"]["status"]
    assert failed.json() == RECORDED["failed_pull_response"]["body"]
    assert failed_stream.status_code == RECORDED["failed_pull_stream"]["status"]
    assert failed_stream.text == RECORDED["failed_pull_stream"]["body"]


async def test_a_decode_replica_with_the_sidecar_prefills_where_the_header_says() -> None:
    config = dataclasses.replace(pd_config(), disagg=DisaggConfig(sidecar=True))
    async with run_sim(config, ports=[0, 0], roles=[Role.PREFILL, Role.DECODE]) as (p, d):
        async with http_client.AsyncClient(timeout=10) as http:
            body = {**decode_body(MODEL, None, 5), "stream": True, "stream_options": {"include_usage": True}}
            named = {"x-prefiller-host-port": f"{p.address}, 127.0.0.1:1"}  # a list: the first one
            streamed = await http.post(f"{d.url}/v1/completions", json=body, headers=named)
            prefills = await sim_requests(p.url)
            plain = await http.post(f"{d.url}/v1/completions", json=body)  # no header: no prefill step
            after_plain = await sim_requests(p.url)
            gone = await http.post(
                f"{d.url}/v1/completions",
                json=body,
                headers={"x-prefiller-host-port": f"127.0.0.1:{free_port()}"},
            )
            p.state.faults.set(parse_fault_header("status=503"), None)
            refused = await http.post(
                f"{d.url}/v1/completions", json=body, headers={"x-prefiller-host-port": p.address}
            )
    assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
    frames = sse_frames(streamed.text)
    assert frames[-1]["usage"]["completion_tokens"] == 5  # the client's own max_tokens and stream_options
    (prefill,) = prefills
    assert (prefill["stream"], prefill["tokens_sent"], prefill["outcome"]) == (False, 1, "completed")
    assert p.state.kv.pulled == 1 and d.state.stats.prompt_by_source["external_kv_transfer"] == PROMPT_TOKENS
    assert plain.status_code == 200 and len(after_plain) == 1
    assert (gone.status_code, gone.content) == (502, b"")  # Go's reverse proxy: prefill unreachable
    assert (refused.status_code, refused.content) == (503, b"")  # the prefill's status, passed on
    assert [r["outcome"] for r in d.state.log.snapshot()].count("prefill-failed") == 2
