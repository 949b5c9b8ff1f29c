"""Stop strings, stop token ids and min_tokens on the simulator's streams, as vLLM 0.32 applies them.

The simulator's tokens are a function of their context (prefix.next_token over the last 8 ids) and a
token's text is " t<id>": a test computes the whole generation from the prompt's ids (simkit.greedy_tokens)
and so where a stop string occurs. vLLM's incremental detokenizer holds back the last max(len(stop)) - 1
characters while the output runs, checks stops once more than min_tokens tokens were generated, and cuts
the text before the stop string (after it with include_stop_str_in_output).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import httpx
import pytest
from simkit import FAST_LATENCY, fast_config, greedy_tokens, sse_frames, texts
from vllm_sim import run_sim
from vllm_sim.prefix import chat_tokens, completion_tokens, token_text
from vllm_sim.sampling import ranked

from loadtest import http_client

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
BASE = {
    "model": "tiny-llama", "stream": True, "ignore_eos": True, "max_tokens": 12, "return_token_ids": True,
    "stream_options": {"include_usage": True},
}  # fmt: skip


def request(endpoint: str, **fields: Any) -> dict[str, Any]:
    where = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": MESSAGES}
    return {**BASE, **where, **fields}


def prompt_ids(endpoint: str) -> list[int]:
    return completion_tokens(PROMPT) if endpoint == "/v1/completions" else chat_tokens(MESSAGES)


def choices(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content chunks' choices (not chat's role chunk, not the usage chunk)."""
    out = [c["choices"][0] for c in chunks if c["choices"]]
    return [c for c in out if "role" not in c.get("delta", {})]


def text(choice: dict[str, Any]) -> str:
    return choice["text"] if "text" in choice else choice["delta"]["content"]


def ids(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in choices(chunks) for t in c["token_ids"]]


async def stream(http: httpx.AsyncClient, endpoint: str, **fields: Any) -> list[dict[str, Any]]:
    response = await http.post(endpoint, json=request(endpoint, **fields))
    assert response.status_code == 200, response.text
    return sse_frames(response.text)


def stop_across(tokens: list[int], k: int) -> tuple[str, int, int]:
    """A stop string made of token k's last 2 characters and token k+1's first 3 (e.g. "34 t4"), where
    it first occurs in the text and the index of the token that completes it."""
    stop = token_text(tokens[k])[-2:] + token_text(tokens[k + 1])[:3]
    start = texts(tokens).find(stop)
    last = next(i for i in range(len(tokens)) if len(texts(tokens[: i + 1])) >= start + len(stop))
    return stop, start, last


async def test_a_stop_string_holds_text_back_while_each_chunk_still_carries_its_ids(
    client: httpx.AsyncClient,
) -> None:
    tokens = greedy_tokens(prompt_ids("/v1/completions"), 12)
    chunks = await stream(client, "/v1/completions", stop=["#" * 8, "##"])  # never produced: holds 7
    body = choices(chunks)
    assert [c["token_ids"] for c in body] == [[t] for t in tokens]
    assert body[0]["text"] == ""  # a token's text is 5 to 7 characters: the first is held back whole
    sent = ""
    for index, choice in enumerate(body[:-1]):
        sent += choice["text"]
        assert sent == texts(tokens[: index + 1])[:-7]
        assert choice["finish_reason"] is None
    last = body[-1]
    assert sent + last["text"] == texts(tokens)  # the held-back text goes out with the finish
    assert (last["finish_reason"], last["stop_reason"]) == ("length", None)
    assert chunks[-1]["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stop_string_across_two_tokens_ends_the_output_before_it(
    client: httpx.AsyncClient, endpoint: str
) -> None:
    tokens = greedy_tokens(prompt_ids(endpoint), 12)
    stop, start, last = stop_across(tokens, 6)
    assert last <= 7
    chunks = await stream(client, endpoint, stop=stop)
    body = choices(chunks)
    assert "".join(text(c) for c in body) == texts(tokens)[:start]
    assert ids(chunks) == tokens[: last + 1]  # the token completing it is the last one
    assert (body[-1]["finish_reason"], body[-1]["stop_reason"]) == ("stop", stop)
    assert all(c["finish_reason"] is None for c in body[:-1])
    usage = chunks[-1]["usage"]
    assert (usage["completion_tokens"], usage["prompt_tokens"]) == (last + 1, len(prompt_ids(endpoint)))


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back(
    client: httpx.AsyncClient, endpoint: str
) -> None:
    tokens = greedy_tokens(prompt_ids(endpoint), 12)
    stop, start, last = stop_across(tokens, 4)
    chunks = await stream(client, endpoint, stop=[stop], include_stop_str_in_output=True)
    body = choices(chunks)
    assert [text(c) for c in body[:-1]] == [token_text(t) for t in tokens[:last]]  # no hold-back
    assert "".join(text(c) for c in body) == texts(tokens)[: start + len(stop)]
    assert (body[-1]["finish_reason"], body[-1]["stop_reason"]) == ("stop", stop)
    assert ids(chunks) == tokens[: last + 1]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("include", [False, True])
async def test_a_stop_token_id_ends_the_output_with_its_id_as_stop_reason(
    client: httpx.AsyncClient, endpoint: str, include: bool
) -> None:
    tokens = greedy_tokens(prompt_ids(endpoint), 12)
    assert tokens[5] not in tokens[:5]
    # id 3 (the template's newline) is never generated
    chunks = await stream(client, endpoint, stop_token_ids=[3, tokens[5]], include_stop_str_in_output=include)
    body = choices(chunks)
    assert ids(chunks) == tokens[:6]  # the stop token's id is sent...
    assert "".join(text(c) for c in body) == texts(tokens[: 6 if include else 5])  # ...its text only if asked
    assert (body[-1]["finish_reason"], body[-1]["stop_reason"]) == ("stop", tokens[5])
    assert chunks[-1]["usage"]["completion_tokens"] == 6


async def test_min_tokens_defers_a_stop_string_until_that_many_tokens(client: httpx.AsyncClient) -> None:
    tokens = greedy_tokens(prompt_ids("/v1/completions"), 12)
    early = await stream(client, "/v1/completions", stop=" t")  # in every token's text
    assert ids(early) == tokens[:1] and "".join(text(c) for c in choices(early)) == ""
    later = await stream(client, "/v1/completions", stop=" t", min_tokens=4)
    assert ids(later) == tokens[:5]  # checked first once more than 4 tokens were generated
    assert "".join(text(c) for c in choices(later)) == texts(tokens[:4])
    assert choices(later)[-1]["stop_reason"] == " t"
    assert later[-1]["usage"]["completion_tokens"] == 5


async def test_min_tokens_masks_the_stop_token_ids_so_the_next_best_token_is_sampled(
    client: httpx.AsyncClient,
) -> None:
    prompt = prompt_ids("/v1/completions")
    tokens = greedy_tokens(prompt, 12)
    chunks = await stream(client, "/v1/completions", stop_token_ids=[tokens[1]], min_tokens=2)
    got = ids(chunks)
    assert got[0] == tokens[0] and got[1] != tokens[1]
    assert got[1] == list(itertools.islice(ranked(prompt + tokens[:1]), 2))[1][0]  # rank 2
    assert got[2:] == greedy_tokens(prompt + got[:2], len(got) - 2)  # greedy again after it
    assert choices(chunks)[-1]["finish_reason"] in ("length", "stop")


async def test_min_tokens_keeps_an_end_of_sequence_back_until_that_many_tokens() -> None:
    config = fast_config(latency=dataclasses.replace(FAST_LATENCY, eos_rate=1.0))  # every output ends early
    plain = {**BASE, "prompt": PROMPT, "ignore_eos": False, "return_token_ids": False}
    async with run_sim(config) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        for min_tokens, tokens, finish in ((8, 9, "stop"), (10, 10, "length")):
            body = {**plain, "max_tokens": 10, "min_tokens": min_tokens}
            chunks = sse_frames((await http.post("/v1/completions", json=body)).text)
            assert chunks[-1]["usage"]["completion_tokens"] == tokens
            assert choices(chunks)[-1]["finish_reason"] == finish
            # min_tokens alone does not change the chunks: the plain (cached) frames
            assert "".join(text(c) for c in choices(chunks)) == " tok" * tokens


async def test_a_continued_request_gives_the_same_tokens_logprobs_and_stop_as_the_uncut_one(
    client: httpx.AsyncClient,
) -> None:
    """As the picker resumes a cut stream: prompt = the prompt's ids + the ids already sent, max_tokens and
    min_tokens less what was sent, the same stop and logprobs."""
    prompt = prompt_ids("/v1/completions")
    tokens = greedy_tokens(prompt, 12)
    stop, start, last = stop_across(tokens, 8)
    fields = {"stop": [stop, "#" * 9], "logprobs": 2, "min_tokens": 3}
    whole = await stream(client, "/v1/completions", **fields)
    uncut = [c["logprobs"] for c in choices(whole)]
    uncut_text = "".join(text(c) for c in choices(whole))
    assert ids(whole) == tokens[: last + 1] and uncut_text == texts(tokens)[:start]
    for k in (1, 4, 7):
        rest = {**fields, "prompt": prompt + tokens[:k], "max_tokens": 12 - k, "min_tokens": max(0, 3 - k)}
        part = sse_frames((await client.post("/v1/completions", json={**BASE, **rest})).text)
        assert ids(part) == tokens[k : last + 1]
        assert choices(part)[-1]["stop_reason"] == stop and choices(part)[-1]["finish_reason"] == "stop"
        assert texts(tokens[:k]) + "".join(text(c) for c in choices(part)) == uncut_text
        shifted = len(texts(tokens[:k]))
        logprobs = [c["logprobs"] for c in choices(part)]
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            assert [v for lp in logprobs for v in lp[key]] == [v for lp in uncut[k:] for v in lp[key]]
        assert [o + shifted for lp in logprobs for o in lp["text_offset"]] == [
            o for lp in uncut[k:] for o in lp["text_offset"]
        ]
        assert part[-1]["usage"]["completion_tokens"] == last + 1 - k


async def test_an_abort_sends_the_held_back_text_with_no_token() -> None:
    async with run_sim(fast_config()) as (replica,), http_client.AsyncClient(base_url=replica.url) as http:
        body = request("/v1/completions", stop="#" * 8, max_tokens=200)
        events: list[str] = []
        slow = {"x-sim-itl-ms": "20"}
        async with http.stream("POST", "/v1/completions", json=body, headers=slow) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 4:
                        assert replica.begin_shutdown()  # abort mode: vLLM's clean cut
    chunks = sse_frames("\n".join(events))
    body_choices = choices(chunks)
    last = body_choices[-1]
    assert (last["finish_reason"], last["token_ids"]) == ("abort", [])
    sent = ids(chunks)
    assert 4 <= len(sent) < 200 and sent == greedy_tokens(prompt_ids("/v1/completions"), len(sent))
    assert last["text"] == texts(sent)[-7:]  # what was held back
    assert "".join(text(c) for c in body_choices) == texts(sent)
    assert chunks[-1]["usage"]["completion_tokens"] == len(sent)
