"""Every request field of the resume table, through `picker proxy` and the simulator (issue 52).

picker/streams/resume_fields.py classifies each field a vLLM 0.32 completions or chat request may
carry. Here each one is sent: a field that is continued must come back exactly as an uncut run of
the same request (text, finish_reason, stop_reason, usage, logprob entries, one chat role chunk)
when every part of the stream is reset after 12 tokens (`x-sim-fault`, which the proxy sends again
with each continuation: a 30-token answer is cut twice); a refused one names its reason in
`x-picker-resume-refused`. The simulator honours stop strings (with vLLM's hold-back), stop token
ids, min_tokens, logprobs and continuous usage as vLLM 0.32 does (tests/sim/test_sim_stops.py).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from vllm_sim.prefix import chat_tokens, text_tokens, token_text

from loadtest.proxy_stack import ProxyStack
from loadtest.stack import StackOptions
from picker.streams.resume_fields import FIELDS, Handling
from tests.sim.simkit import greedy_tokens

MODEL = "tiny-llama"
PROMPT = "Tell me about the fields."
MESSAGES = [{"role": "user", "content": "Tell me about the fields."}]
TOKENS = 30
CUT = 12  # every part is reset after this many of its own tokens
BASE = {"model": MODEL, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}  # fmt: skip
ANSWER = greedy_tokens(text_tokens(PROMPT), TOKENS)
CHAT_ANSWER = greedy_tokens(chat_tokens(MESSAGES), TOKENS)


def straddling(answer: list[int]) -> str:
    """A stop string made of the end of token CUT's text and the start of the next one's: the cut
    falls inside it."""
    before, after = token_text(answer[CUT - 1]), token_text(answer[CUT])
    stop = before[-3:] + after[:3]
    assert (
        "".join(token_text(t) for t in answer).find(stop)
        == len("".join(token_text(t) for t in answer[:CUT])) - 3
    )
    return stop


# field -> (the value sent, the endpoint it belongs to); the table's refusals are sent as asked
CONTINUED: dict[str, tuple[Any, str]] = {
    "model": (MODEL, "completions"),
    "prompt": (PROMPT, "completions"),
    "messages": (MESSAGES, "chat"),
    "max_tokens": (TOKENS, "completions"),
    "max_completion_tokens": (TOKENS, "chat"),
    "min_tokens": (20, "completions"),
    "stream": (True, "completions"),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, "completions"),
    "stop": ([straddling(ANSWER)], "completions"),
    "stop_token_ids": ([ANSWER[19]], "completions"),
    "include_stop_str_in_output": (True, "completions"),
    "ignore_eos": (True, "completions"),
    "temperature": (0, "completions"),
    "top_p": (0.9, "completions"),
    "top_k": (5, "completions"),
    "min_p": (0.05, "completions"),
    "repetition_penalty": (1.1, "completions"),
    "logit_bias": ({"5": 1.0}, "completions"),
    "allowed_token_ids": (None, "completions"),
    "logprobs": (2, "completions"),
    "top_logprobs": (2, "chat"),
    "return_token_ids": (True, "completions"),
    "return_tokens_as_token_ids": (True, "completions"),
    "skip_special_tokens": (True, "completions"),
    "spaces_between_special_tokens": (True, "completions"),
    "add_special_tokens": (True, "completions"),
    "chat_template": ("{{ messages }}", "chat"),
    "chat_template_kwargs": ({"enable_thinking": False}, "chat"),
    "add_generation_prompt": (True, "chat"),
    "continue_final_message": (False, "chat"),
    "documents": ([], "chat"),
    "reasoning_effort": ("low", "chat"),
    "user": ("someone", "completions"),
    "priority": (0, "completions"),
    "cache_salt": ("salt-1", "completions"),
    "request_id": ("my-request-1", "completions"),
    "vllm_xargs": ({"k": 1}, "completions"),
    "seed": (7, "completions"),
    "bad_words": (["never"], "completions"),
    "tool_choice": ("none", "chat"),
    "parallel_tool_calls": (False, "chat"),
    "guided_decoding_backend": ("xgrammar", "completions"),
}
REFUSED: dict[str, Any] = {
    "n": 2, "best_of": 2, "use_beam_search": True, "echo": True, "suffix": "end", "prompt_embeds": "AAAA",
    "prompt_logprobs": 1, "presence_penalty": 0.5, "frequency_penalty": 0.5, "truncate_prompt_tokens": 5,
    "response_format": {"type": "json_object"}, "structured_outputs": {"json": {}}, "guided_json": {},
    "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "root ::= 'a'",
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "kv_transfer_params": {"do_remote_decode": True}, "mm_processor_kwargs": {"num_crops": 4},
}  # fmt: skip


def test_the_table_and_this_test_name_the_same_fields() -> None:
    assert set(CONTINUED) | set(REFUSED) == set(FIELDS)
    assert {f for f in FIELDS if FIELDS[f].handling is Handling.REFUSED} == set(REFUSED)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyStack]:
    options = StackOptions(
        replicas=3,
        sim_args=("--ttft-ms", "2", "--itl-ms", "2"),
        replica_args=((), (), ()),
        picker_env={"PICKER_STREAMS__RESUME": "greedy"},
    )
    started = ProxyStack(tmp_path_factory.mktemp("resume-fields"), options).start()
    try:
        yield started
    finally:
        started.stop()


def body_for(name: str, value: Any, endpoint: str) -> tuple[str, dict[str, Any]]:
    if endpoint == "chat":
        body: dict[str, Any] = {**BASE, "messages": MESSAGES}
        if name == "top_logprobs":
            body["logprobs"] = True
    else:
        body = {**BASE, "prompt": PROMPT}
    if name == "include_stop_str_in_output":
        body["stop"] = [straddling(ANSWER)]
    if name == "max_completion_tokens":
        body.pop("max_tokens")
    if value is not None:
        body[name] = value
    return ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions"), body


async def read(session: aiohttp.ClientSession, url: str, body: dict[str, Any], fault: bool) -> dict[str, Any]:
    headers = {"x-picker-resume": "on", **({"x-sim-fault": f"reset-after={CUT}"} if fault else {})}
    out: dict[str, Any] = {"text": "", "finish": [], "stop_reason": [], "usage": [], "logprobs": [],
                           "roles": 0, "done": 0, "ids": []}  # fmt: skip
    async with session.post(url, json=body, headers=headers) as response:
        assert response.status == 200, await response.text()
        out["refused"] = response.headers.get("x-picker-resume-refused")
        raw = await response.read()
    for event in raw.split(b"\n\n"):
        data = event.removeprefix(b"data: ")
        if not data:
            continue
        if data == b"[DONE]":
            out["done"] += 1
            continue
        frame = json.loads(data)
        assert "error" not in frame, frame
        if frame.get("usage"):
            out["usage"].append(frame["usage"])
        for choice in frame.get("choices") or []:
            delta = choice.get("delta") or {}
            out["roles"] += "role" in delta
            out["text"] += choice.get("text") or delta.get("content") or ""
            out["ids"] += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                out["finish"].append(choice["finish_reason"])
                out["stop_reason"].append(choice.get("stop_reason"))
            logprobs = choice.get("logprobs")
            if isinstance(logprobs, dict):
                out["logprobs"].append(json.dumps(logprobs, sort_keys=True))
    return out


def flat_logprobs(entries: list[str]) -> list[Any]:
    """Per-token entries, whatever the chunking (completions' parallel lists, chat's content)."""
    out: list[Any] = []
    for entry in map(json.loads, entries):
        if "content" in entry:
            out += entry["content"]
        else:
            out += list(zip(entry["tokens"], entry["token_logprobs"], entry["text_offset"], strict=True))
    return out


async def resumes(stack: ProxyStack) -> float:
    page = await asyncio.to_thread(stack.picker_metrics)
    return sum(v for (name, labels), v in page.items() if name == "picker_stream_resumes_total"
               and dict(labels)["reason"] == "upstream-reset")  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONTINUED))
async def test_a_continued_field_comes_back_as_an_uncut_run(stack: ProxyStack, name: str) -> None:
    value, endpoint = CONTINUED[name]
    path, body = body_for(name, value, endpoint)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        uncut = await read(session, stack.url + path, body, fault=False)
        before = await resumes(stack)
        cut = await read(session, stack.url + path, body, fault=True)
    assert cut["refused"] is None and uncut["refused"] is None
    expected_cuts = 2 if uncut["usage"][-1]["completion_tokens"] > 2 * CUT else 1
    assert await resumes(stack) - before == expected_cuts  # it was cut, and continued
    for key in ("text", "finish", "stop_reason", "usage", "roles", "done", "ids"):
        assert cut[key] == uncut[key], key
    assert flat_logprobs(cut["logprobs"]) == flat_logprobs(uncut["logprobs"])
    if name in ("logprobs", "top_logprobs"):
        assert len(flat_logprobs(uncut["logprobs"])) == TOKENS
    if name in ("stop", "include_stop_str_in_output"):
        assert uncut["finish"] == ["stop"]  # the stop string straddles the first cut
    if name == "stop_token_ids":
        assert uncut["stop_reason"] == [ANSWER[19]]
    assert uncut["roles"] == (1 if endpoint == "chat" else 0) and uncut["done"] == 1


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_a_refused_field_says_why(stack: ProxyStack, name: str) -> None:
    endpoint = "chat" if name in ("tools",) else "completions"
    path, body = body_for(name, REFUSED[name], endpoint)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(stack.url + path, json=body, headers={"x-picker-resume": "on"}) as response:
            await response.read()
            assert response.headers.get("x-picker-resume-refused") == FIELDS[name].reason
