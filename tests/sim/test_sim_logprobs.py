"""logprobs, continuous usage stats and the sampling fields' 400s on the simulator's streams (vLLM 0.32).

Logprob values are a deterministic function of the context (vllm_sim.sampling.ranked): each
generated token gets one entry, in each endpoint's shape, whatever the chunk's size.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import pytest
from simkit import FAST_LATENCY, fast_config, greedy_tokens, sse_frames, texts
from vllm_sim import run_sim
from vllm_sim.config import CacheConfig
from vllm_sim.prefix import chat_tokens, completion_tokens, token_text

from loadtest import http_client

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
COMPLETION = {
    "model": "tiny-llama", "prompt": PROMPT, "stream": True, "ignore_eos": True, "max_tokens": 10,
    "return_token_ids": True, "stream_options": {"include_usage": True},
}  # fmt: skip
CHAT = {**{k: v for k, v in COMPLETION.items() if k != "prompt"}, "messages": MESSAGES}
BY_THREE = dataclasses.replace(FAST_LATENCY, tokens_per_chunk=3)  # chunks of 1, 3, 3, 3 tokens


def content(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [c["choices"][0] for c in chunks if c["choices"]]
    return [c for c in out if "role" not in c.get("delta", {})]


async def test_completions_logprobs_one_entry_per_token_of_each_chunk() -> None:
    tokens = greedy_tokens(completion_tokens(PROMPT), 10)
    async with (
        run_sim(fast_config(latency=BY_THREE)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        chunks = sse_frames((await http.post("/v1/completions", json={**COMPLETION, "logprobs": 2})).text)
    body = content(chunks)
    assert [len(c["token_ids"]) for c in body] == [1, 3, 3, 3]
    offset = 0
    for choice in body:
        logprobs = choice["logprobs"]
        assert list(logprobs) == ["text_offset", "token_logprobs", "tokens", "top_logprobs"]
        assert logprobs["tokens"] == [token_text(t) for t in choice["token_ids"]]
        assert len(logprobs["text_offset"]) == len(logprobs["token_logprobs"]) == len(choice["token_ids"])
        for token, value, top, start in zip(
            logprobs["tokens"],
            logprobs["token_logprobs"],
            logprobs["top_logprobs"],
            logprobs["text_offset"],
            strict=True,
        ):
            assert start == offset  # counted from the tokens reported before
            offset += len(token)
            # the sampled token first, then the 2 likeliest: greedy, it is the likeliest (no third key)
            assert next(iter(top)) == token and top[token] == value and len(top) == 2
            assert value < 0 and sorted(top.values(), reverse=True) == list(top.values())
    assert "".join(c["text"] for c in body) == texts(tokens)


async def test_completions_logprobs_zero_gives_the_sampled_token_alone(client: httpx.AsyncClient) -> None:
    chunks = sse_frames((await client.post("/v1/completions", json={**COMPLETION, "logprobs": 0})).text)
    for choice in content(chunks):
        (token,) = choice["logprobs"]["tokens"]
        assert choice["logprobs"]["top_logprobs"] == [{token: choice["logprobs"]["token_logprobs"][0]}]


@pytest.mark.parametrize(("top", "shown"), [(None, 0), (0, 0), (3, 3)])
async def test_chat_logprobs_content_one_entry_per_token(top: int | None, shown: int) -> None:
    tokens = greedy_tokens(chat_tokens(MESSAGES), 10)
    body = {**CHAT, "logprobs": True, **({} if top is None else {"top_logprobs": top})}
    async with (
        run_sim(fast_config(latency=BY_THREE)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        chunks = sse_frames((await http.post("/v1/chat/completions", json=body)).text)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    entries = []
    for choice in content(chunks):
        assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
        entries += choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [token_text(t) for t in tokens]
    for entry in entries:
        assert list(entry) == ["token", "logprob", "bytes", "top_logprobs"]
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == shown
        if shown:
            assert entry["top_logprobs"][0] == {k: entry[k] for k in ("token", "logprob", "bytes")}
    # the same values as the completions endpoint gives for the same context
    same = {**COMPLETION, "prompt": chat_tokens(MESSAGES), "logprobs": 3}
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        plain = sse_frames((await http.post("/v1/completions", json=same)).text)
    values = [v for c in content(plain) for v in c["logprobs"]["token_logprobs"]]
    assert [e["logprob"] for e in entries] == values


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_continuous_usage_stats_put_the_running_usage_in_every_chunk(
    client: httpx.AsyncClient, endpoint: str
) -> None:
    chat = endpoint == "/v1/chat/completions"
    body = {**(CHAT if chat else COMPLETION), "return_token_ids": False}
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    chunks = sse_frames((await client.post(endpoint, json=body)).text)
    prompt = len(chat_tokens(MESSAGES) if chat else completion_tokens(PROMPT))
    *streamed, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 10
    tail = {"completion_tokens_details": None} if chat else {}
    expected = [
        {"prompt_tokens": prompt, "total_tokens": prompt + n, "completion_tokens": n, **tail}
        for n in range(11)
    ]
    usages = [c["usage"] for c in streamed]
    assert usages == (expected if chat else expected[1:])  # chat's role chunk: 0 tokens
    assert all(list(u)[:3] == ["prompt_tokens", "total_tokens", "completion_tokens"] for u in usages)
    without = {**body, "stream_options": {"continuous_usage_stats": True}}  # needs include_usage too
    plain = sse_frames((await client.post(endpoint, json=without)).text)
    assert all(c.get("usage") is None for c in plain)


async def test_default_valued_fields_keep_the_plain_frames(client: httpx.AsyncClient) -> None:
    defaults = {"stop": [], "stop_token_ids": [], "min_tokens": 0, "logprobs": None, "prompt_logprobs": None}
    body = {**COMPLETION, **defaults, "return_token_ids": False, "include_stop_str_in_output": False}
    chunks = sse_frames((await client.post("/v1/completions", json=body)).text)
    assert "".join(c["text"] for c in content(chunks)) == " tok" * 10


async def test_prompt_logprobs_zero_streams_as_usual_but_skips_reading_the_prefix_cache() -> None:
    config = fast_config(cache=CacheConfig(block_size=4, prompt_tokens_details=True))
    body = {**COMPLETION, "prompt": "a prompt long enough to fill several blocks of four tokens"}
    async with run_sim(config) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        await http.post("/v1/completions", json=body)
        cached = sse_frames((await http.post("/v1/completions", json=body)).text)
        skipped = sse_frames((await http.post("/v1/completions", json={**body, "prompt_logprobs": 0})).text)
    assert cached[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert skipped[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert content(skipped)[-1]["finish_reason"] == "length"


CHAT_PATH = "/v1/chat/completions"
BAD = [
    (CHAT_PATH, {"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true."),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": -2}, "`top_logprobs` must be a positive value or -1."),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, "Requested sample logprobs of 21"),
    (CHAT_PATH, {"logprobs": "maybe"}, "logprobs: Input should be a valid boolean"),
    ("/v1/completions", {"logprobs": -2}, "`logprobs` must be a positive value or -1."),
    ("/v1/completions", {"logprobs": "2"}, "`logprobs` must be an integer."),
    ("/v1/completions", {"logprobs": -1}, "Requested sample logprobs of 50100"),
    ("/v1/completions", {"prompt_logprobs": 1}, "`prompt_logprobs` are not available when `stream=True`."),
    ("/v1/completions", {"stream": False, "stream_options": None, "prompt_logprobs": 0}, "not supported"),
    ("/v1/completions", {"stop": ["a", "b", "c", "d", "e"]}, "at most 4 items"),
    ("/v1/completions", {"stop": [""]}, "stop cannot contain an empty string."),
    ("/v1/completions", {"stop_token_ids": [60_000]}, "out-of-vocab token ids. Vocabulary size: 50100"),
    ("/v1/completions", {"min_tokens": 11}, "must be less than or equal to max_tokens=10, got 11."),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens must be greater than or equal to 0, got -1."),
    ("/v1/completions", {"include_stop_str_in_output": None}, "Input should be a valid boolean"),
]  # fmt: skip


@pytest.mark.parametrize(("endpoint", "fields", "message"), BAD)
async def test_invalid_sampling_fields_are_400s_as_vllm_words_them(
    client: httpx.AsyncClient, endpoint: str, fields: dict[str, Any], message: str
) -> None:
    body = {**(CHAT if endpoint.endswith("chat/completions") else COMPLETION), **fields}
    response = await client.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]["message"]


async def test_a_lax_value_is_read_as_vllm_reads_it(client: httpx.AsyncClient) -> None:
    """pydantic's lax mode: completions `logprobs: true` is 1, `min_tokens: "2"` is 2."""
    body = {**COMPLETION, "logprobs": True, "min_tokens": "2", "stop": " t"}
    chunks = sse_frames((await client.post("/v1/completions", json=body)).text)
    assert len(content(chunks)[0]["logprobs"]["top_logprobs"][0]) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 3
