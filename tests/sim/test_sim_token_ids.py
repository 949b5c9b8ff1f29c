"""The simulator's `return_token_ids` and greedy tokens (issue 42): what a stream resume needs.

vLLM 0.32 under `return_token_ids` writes the prompt's ids in the first completions chunk (at the top
level of chat's role chunk) and each chunk's generated ids; a completions prompt may be token ids.
Under greedy decoding a generation continued from its prompt plus its first k tokens gives exactly
the tokens the uncut one did: the simulator's tokens are a function of the context, so it does too.
"""

from __future__ import annotations

import json
from typing import Any

from simkit import fast_config
from vllm_sim import run_sim

from loadtest import http_client

BASE = {
    "model": "tiny-llama", "stream": True, "ignore_eos": True, "return_token_ids": True,
    "stream_options": {"include_usage": True},
}  # fmt: skip


def frames(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def generated(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids") or []]


async def test_a_completion_continued_from_its_token_ids_gives_the_same_tokens() -> None:
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = {**BASE, "prompt": "Once upon a time", "max_tokens": 12}
        whole = frames((await http.post("/v1/completions", json=body)).text)
        prompt_ids = whole[0]["choices"][0]["prompt_token_ids"]
        tokens = generated(whole)
        assert len(tokens) == 12 and isinstance(prompt_ids, list) and prompt_ids
        assert all(c["choices"][0]["prompt_token_ids"] is None for c in whole[1:] if c["choices"])
        text = "".join(c["choices"][0]["text"] for c in whole if c["choices"])
        for k in (1, 5, 11):
            rest = {**body, "prompt": prompt_ids + tokens[:k], "max_tokens": 12 - k}
            continued = frames((await http.post("/v1/completions", json=rest)).text)
            assert generated(continued) == tokens[k:]
            assert continued[-1]["usage"] == {
                "prompt_tokens": len(prompt_ids) + k,
                "total_tokens": len(prompt_ids) + 12,
                "completion_tokens": 12 - k,
            }
        again = frames((await http.post("/v1/completions", json=body)).text)
        assert generated(again) == tokens  # the same request twice: the same tokens
        assert "".join(c["choices"][0]["text"] for c in again if c["choices"]) == text


async def test_chat_carries_the_prompt_ids_at_the_top_level_of_its_first_chunk() -> None:
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = {**BASE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
        chat = frames((await http.post("/v1/chat/completions", json=body)).text)
        assert chat[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        prompt_ids = chat[0]["prompt_token_ids"]
        tokens = generated(chat)
        assert len(tokens) == 6 and "prompt_token_ids" not in chat[1]
        # the rest of a chat generation, asked of the completions endpoint from the template's ids
        rest = {**BASE, "prompt": prompt_ids + tokens[:2], "max_tokens": 4}
        continued = frames((await http.post("/v1/completions", json=rest)).text)
        assert generated(continued) == tokens[2:]


async def test_without_the_flag_nothing_changes_and_a_bad_flag_is_a_400() -> None:
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = {**BASE, "prompt": "x", "max_tokens": 2, "return_token_ids": False}
        plain = frames((await http.post("/v1/completions", json=body)).text)
        assert plain[0]["choices"][0]["token_ids"] is None
        bad = await http.post("/v1/completions", json={**body, "return_token_ids": "yes"})
        assert bad.status_code == 400
