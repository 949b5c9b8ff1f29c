"""The OpenAI API surface of the simulator: shapes, validation, identity, request log, overrides."""

from __future__ import annotations

import dataclasses

import httpx
import parity_checks as pc
import pytest
from simkit import fast_config, sim_requests
from vllm_sim import LatencyConfig, Replica, run_sim

from loadtest import http_client
from loadtest.sse_client import stream_request


def target(replica: Replica) -> pc.Target:
    return pc.Target(replica.url, model=replica.config.model)


async def test_health_and_models(sim: Replica) -> None:
    await pc.check_health_and_models(target(sim))


async def test_sse_format_matches_vllm(sim: Replica) -> None:
    await pc.check_sse_format(target(sim), max_tokens=12)


async def test_non_streaming_shapes(sim: Replica) -> None:
    await pc.check_non_streaming(target(sim), max_tokens=6)


async def test_unknown_model_is_404(sim: Replica) -> None:
    await pc.check_unknown_model_404(target(sim))


async def test_malformed_json_is_400(sim: Replica) -> None:
    await pc.check_malformed_json_400(target(sim))


async def test_unknown_model_body_is_exactly_vllms(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"model": "x", "prompt": "hi"})
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "message": "The model `x` does not exist. Valid aliases: tiny-llama.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


@pytest.mark.parametrize(
    ("path", "body", "error_type", "message_part"),
    [
        ("/v1/completions", {"model": "tiny-llama"}, "Bad Request", "prompt"),
        ("/v1/completions", {"prompt": ""}, "Bad Request", "prompt"),
        ("/v1/completions", [1, 2], "Bad Request", "dictionary"),
        ("/v1/chat/completions", {"model": "tiny-llama"}, "Bad Request", "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "Bad Request", "role"),
        ("/v1/completions", {"prompt": "a", "stream": "yes"}, "Bad Request", "stream"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "9"}, "Bad Request", "max_tokens"),
        (
            "/v1/completions",
            {"prompt": "a", "stream_options": {"include_usage": True}},
            "Bad Request",
            "stream",
        ),
        ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "BadRequestError", "at least 1"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 9000}, "BadRequestError", "maximum context length"),
        ("/v1/completions", {"prompt": "a", "n": 2}, "BadRequestError", "n=1"),
    ],
)
async def test_bad_requests_get_vllm_style_400(
    client: httpx.AsyncClient, path: str, body: object, error_type: str, message_part: str
) -> None:
    response = await client.post(path, json=body)
    pc.check_error(response, 400, error_type, message_part)


async def test_missing_model_uses_the_served_name(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert response.status_code == 200
    assert response.json()["model"] == "tiny-llama"
    assert response.json()["usage"]["completion_tokens"] == 3


async def test_default_max_tokens_and_token_id_prompts(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4, 5]})
    usage = response.json()["usage"]
    assert usage == {
        "prompt_tokens": 5,
        "total_tokens": 21,
        "completion_tokens": 16,
        "prompt_tokens_details": None,
    }


async def test_every_response_names_the_replica(sim: Replica, client: httpx.AsyncClient) -> None:
    responses = [
        await client.get("/health"),
        await client.get("/metrics"),
        await client.get("/v1/models"),
        await client.get("/no/such/route"),
        await client.post("/v1/completions", json={"model": "nope", "prompt": "x"}),
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}),
    ]
    streamed = await stream_request(
        client, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True}
    )
    headers = [r.headers for r in responses] + [streamed.headers]
    assert all(h["x-sim-replica"] == sim.address for h in headers)


async def test_unknown_route_answers_like_fastapi(client: httpx.AsyncClient) -> None:
    response = await client.get("/v2/nothing")
    assert response.status_code == 404 and response.json() == {"detail": "Not Found"}
    response = await client.get("/v1/completions")
    assert response.status_code == 405 and response.json() == {"detail": "Method Not Allowed"}


async def test_request_log_records_each_request(sim: Replica, client: httpx.AsyncClient) -> None:
    body = {"prompt": "hello there", "max_tokens": 4, "stream": True}
    await stream_request(client, "/v1/completions", body, headers={"x-request-id": "req-42"})
    await client.post(
        "/v1/completions", json={"model": "nope", "prompt": "x"}, headers={"x-request-id": "req-43"}
    )
    (entry,) = await sim_requests(sim.url, "req-42")
    assert entry["path"] == "/v1/completions" and entry["model"] == "tiny-llama" and entry["stream"] is True
    assert (
        entry["outcome"] == "completed" and entry["finish_reason"] == "length" and entry["tokens_sent"] == 4
    )
    assert entry["arrival"] <= entry["first_token_at"] <= entry["end"]
    (missing,) = await sim_requests(sim.url, "req-43")
    assert missing["outcome"] == "not-found" and missing["status"] == 404
    assert (await client.delete("/sim/requests")).status_code == 200
    assert await sim_requests(sim.url) == []


async def test_request_log_is_bounded() -> None:
    async with (
        run_sim(fast_config(request_log_size=3)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        for index in range(5):
            await http.post(
                "/v1/completions",
                json={"prompt": "x", "max_tokens": 1},
                headers={"x-request-id": f"r{index}"},
            )
        assert [e["request_id"] for e in await sim_requests(replica.url)] == ["r2", "r3", "r4"]


async def test_generated_ids_are_unique_without_x_request_id(sim: Replica, client: httpx.AsyncClient) -> None:
    for _ in range(3):
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    ids = [e["request_id"] for e in await sim_requests(sim.url)]
    assert len(set(ids)) == 3


async def test_max_tokens_override_header_gives_exact_count(client: httpx.AsyncClient) -> None:
    result = await stream_request(
        client,
        "/v1/completions",
        {"prompt": "x", "max_tokens": 3, "stream": True},
        headers={"x-sim-max-tokens": "9"},
    )
    assert len(result.content_chunks) == 9 and result.finish_reason == "length"


@pytest.mark.parametrize("header", ["x-sim-ttft-ms", "x-sim-itl-ms", "x-sim-max-tokens", "x-sim-fault"])
async def test_malformed_sim_headers_are_400(client: httpx.AsyncClient, header: str) -> None:
    response = await client.post("/v1/completions", json={"prompt": "x"}, headers={header: "soon"})
    pc.check_error(response, 400, "BadRequestError", header.removeprefix("x-sim-").split("-")[0])


async def test_early_stop_is_seeded_and_deterministic() -> None:
    latency = dataclasses.replace(fast_config().latency, eos_rate=1.0, seed=7)
    async with (
        run_sim(fast_config(latency=latency)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        body = {"prompt": "x", "max_tokens": 50, "stream": True}
        first = await stream_request(http, "/v1/completions", body, headers={"x-request-id": "same"})
        again = await stream_request(http, "/v1/completions", body, headers={"x-request-id": "same"})
        forced = await stream_request(
            http, "/v1/completions", {**body, "ignore_eos": True}, headers={"x-request-id": "same"}
        )
    assert first.finish_reason == again.finish_reason == "stop"
    assert len(first.content_chunks) == len(again.content_chunks) < 50
    assert forced.finish_reason == "length" and len(forced.content_chunks) == 50


async def test_tokens_per_chunk_batches_tokens() -> None:
    latency = LatencyConfig(ttft_ms=1, itl_ms=1, tokens_per_chunk=4)
    async with (
        run_sim(fast_config(latency=latency)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        body = {"prompt": "x", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
        result = await stream_request(http, "/v1/completions", body)
    texts = [c["choices"][0]["text"] for c in result.content_chunks]
    assert [t.count(" tok") for t in texts] == [1, 4, 4, 1]  # the first token is never held back
    assert result.usage is not None and result.usage["completion_tokens"] == 10
