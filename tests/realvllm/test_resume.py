"""Streams that survive their replica, on real vLLM 0.32 (issue 42): token for token under greedy.

One real vLLM (CPU build, the tiny model) reached through two TCP relays the test controls: the
picker proxy sees two replicas. A greedy stream is cut once k of its tokens have left the engine
(a tripwire armed on both relays, counting vLLM's token ids: the one serving it resets every
connection and refuses new ones, what a killed replica's peer sees), whatever the client has read.
The proxy continues it through the other relay from the prompt's token ids plus
the tokens sent (`return_token_ids`, a token-id prompt). The text the client reads must equal an
uncut run's, for completions and for chat, at cut points 1, 50, 120 and 199 of 200 tokens.

Two relays to one engine rather than two engines: each vLLM start costs ~25 s and ~2 GB of this tier's
budget, and the claim under test (greedy continuation from token ids gives the same tokens, and the
splice loses or repeats none) does not depend on which process decodes the rest.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loadtest.proxy_stack import ProxyStack
from loadtest.realvllm import launcher
from loadtest.relay import Relay, Tripwire
from loadtest.stack import StackOptions

pytestmark = [pytest.mark.realvllm, pytest.mark.timeout(300)]

TOKENS = 200
BASE = {
    "model": launcher.SERVED_MODEL_NAME, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
    "stream": True, "stream_options": {"include_usage": True},
}  # fmt: skip
COMPLETION = {**BASE, "prompt": "The history of the picker began when"}
CHAT = {**BASE, "messages": [{"role": "user", "content": "Tell me about the sea."}]}
RUNS = [("/v1/completions", COMPLETION, k) for k in (1, 50, 120, 199, 50)] + [
    ("/v1/chat/completions", CHAT, k) for k in (1, 50, 120, 199, 50)
]


@pytest.fixture(scope="module")
def resume_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyStack, dict[str, Relay]]]:
    workdir = tmp_path_factory.mktemp("realvllm-resume")
    with launcher.real_vllm(launcher.free_port(), workdir) as server:
        relays = [Relay(server.port).start() for _ in range(2)]
        addresses = {f"127.0.0.1:{relay.port}": relay for relay in relays}
        options = StackOptions(
            replicas=0, picker_endpoints=list(addresses), picker_env={"PICKER_STREAMS__RESUME": "greedy"}
        )
        stack = ProxyStack(Path(workdir), options).start()
        try:
            yield stack, addresses
        finally:
            stack.stop()
            for relay in relays:
                relay.stop()


def read(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One stream: its text, finish reasons, usage, [DONE] count."""
    text, finish, usage, done, count = [], [], None, 0, 0
    with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done += 1
                continue
            frame = json.loads(line[6:])
            assert "error" not in frame, frame
            for choice in frame.get("choices") or []:
                assert "token_ids" not in choice or choice["token_ids"] is None  # the client did not ask
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece is not None and "role" not in (choice.get("delta") or {}):
                    count += 1
                    text.append(piece)
                if choice.get("finish_reason"):
                    finish.append(choice["finish_reason"])
            usage = frame.get("usage") or usage
    return {"text": "".join(text), "finish": finish, "usage": usage, "done": done, "chunks": count}


@pytest.mark.parametrize(("path", "body", "at"), RUNS)
def test_a_greedy_stream_cut_after_k_tokens_completes_identically(
    resume_stack: tuple[ProxyStack, dict[str, Relay]], path: str, body: dict[str, Any], at: int
) -> None:
    stack, relays = resume_stack
    before = resumes(stack)
    with httpx.Client(timeout=120) as client:
        uncut = read(client, stack.url, path, body)
    resumed, tripwire = cut_run(stack, relays, path, body, at, read)
    assert tripwire.fired is not None, "the stream ended before the cut point"
    assert uncut["finish"] == ["length"] and uncut["done"] == 1
    assert resumed["text"] == uncut["text"]
    assert resumed["finish"] == ["length"] and resumed["done"] == 1
    assert resumed["usage"]["completion_tokens"] == uncut["usage"]["completion_tokens"] == TOKENS
    assert resumed["usage"]["prompt_tokens"] == uncut["usage"]["prompt_tokens"]
    # the engine may send two tokens in one event when its reader lags: a cut meant for token 199
    # can land after the 200th, where only the stream's end is left (written by the proxy itself)
    assert resumes(stack) == before + (1 if tripwire.seen < TOKENS else 0)


def resumes(stack: ProxyStack) -> float:
    metrics = stack.picker_metrics()
    return sum(v for (name, _), v in metrics.items() if name == "picker_stream_resumes_total")


# ---- issue 52: resume, exact, in the request shapes real clients send

STOP_NEVER = {**COMPLETION, "stop": ["</answer>"]}  # never produced: vLLM holds back 8 characters
LOGPROBS = {**COMPLETION, "logprobs": 2}
CHAT_LOGPROBS = {**CHAT, "logprobs": True}
CHAT_TOP = {**CHAT, "logprobs": True, "top_logprobs": 2}
EXACT_RUNS = [
    ("/v1/completions", STOP_NEVER, 50),
    ("/v1/completions", LOGPROBS, 50),
    ("/v1/chat/completions", CHAT_LOGPROBS, 50),
    ("/v1/chat/completions", CHAT_TOP, 120),
]


def read_all(client: httpx.Client, url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One stream, everything a client compares: text, finish and stop reasons, usage, logprob
    entries (tokens and values), role chunks, [DONE] count, per-chunk (ids, text) when asked."""
    out: dict[str, Any] = {"text": [], "finish": [], "stop_reason": [], "usage": None, "done": 0,
                           "tokens": [], "values": [], "tops": [], "roles": 0, "pieces": []}  # fmt: skip
    with client.stream("POST", url + path, json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] += 1
                continue
            frame = json.loads(line[6:])
            assert "error" not in frame, frame
            for choice in frame.get("choices") or []:
                delta = choice.get("delta") or {}
                out["roles"] += "role" in delta
                piece = choice.get("text") if "text" in choice else delta.get("content")
                out["text"].append(piece or "")
                if choice.get("token_ids") is not None:
                    out["pieces"].append((choice["token_ids"], piece or ""))
                if choice.get("finish_reason"):
                    out["finish"].append(choice["finish_reason"])
                    out["stop_reason"].append(choice.get("stop_reason"))
                logprobs = choice.get("logprobs")
                if isinstance(logprobs, dict) and "content" in logprobs:
                    for entry in logprobs["content"] or []:
                        out["tokens"].append(entry["token"])
                        out["values"].append(round(entry["logprob"], 3))
                        out["tops"].append([top["token"] for top in entry["top_logprobs"]])
                elif isinstance(logprobs, dict):
                    out["tokens"] += logprobs["tokens"]
                    out["values"] += [round(v, 3) for v in logprobs["token_logprobs"]]
                    out["tops"] += [sorted(top) for top in logprobs["top_logprobs"]]
            out["usage"] = frame.get("usage") or out["usage"]
    out["text"] = "".join(out["text"])
    return out


def cut_run(
    stack: ProxyStack, relays: dict[str, Relay], path: str, body: dict[str, Any], at: int, reader: Any = None
) -> Any:
    """The same request with a tripwire at `at` tokens on both relays: (what the client read with
    `reader`, `read_all` by default; the tripwire)."""
    tripwire = Tripwire(at)
    for relay in relays.values():
        relay.tripwire = tripwire
    try:
        with httpx.Client(timeout=120) as client:
            resumed = (reader or read_all)(client, stack.url, path, body)
    finally:
        for relay in relays.values():
            relay.tripwire = None
        if tripwire.fired is not None:
            tripwire.fired.restore()
    return resumed, tripwire


@pytest.mark.parametrize(("path", "body", "at"), EXACT_RUNS)
def test_stop_lists_and_logprobs_come_back_whole_after_a_cut(
    resume_stack: tuple[ProxyStack, dict[str, Relay]], path: str, body: dict[str, Any], at: int
) -> None:
    stack, relays = resume_stack
    with httpx.Client(timeout=120) as client:
        uncut = read_all(client, stack.url, path, body)
    resumed, tripwire = cut_run(stack, relays, path, body, at)
    assert tripwire.fired is not None, "the stream ended before the cut point"
    assert resumed["text"] == uncut["text"] and len(uncut["text"]) > 0
    assert resumed["finish"] == uncut["finish"] == ["length"] and resumed["done"] == 1
    assert resumed["usage"] == uncut["usage"]
    assert resumed["tokens"] == uncut["tokens"] and len(resumed["tokens"]) == (
        TOKENS if body.get("logprobs") else 0
    )
    assert resumed["values"] == uncut["values"] and resumed["tops"] == uncut["tops"]
    assert resumed["roles"] == uncut["roles"] == (1 if path.endswith("chat/completions") else 0)


def test_a_stop_string_that_straddles_the_cut_ends_the_stream_where_an_uncut_run_does(
    resume_stack: tuple[ProxyStack, dict[str, Relay]],
) -> None:
    """A stop string made of the end of token j-1's text and the start of token j's; the cut falls
    between the two (the continuation's engine never sees the first half)."""
    stack, relays = resume_stack
    with httpx.Client(timeout=120) as client:
        plain = read_all(client, stack.url, "/v1/completions", {**COMPLETION, "return_token_ids": True})
        pieces = plain["pieces"]
        text_before = [sum(len(p) for _, p in pieces[:i]) for i in range(len(pieces))]
        chosen = None
        for j in range(2, len(pieces) - 1):  # the tiny model soon repeats one token: look early
            (ids_a, a), (ids_b, b) = pieces[j - 1], pieces[j]
            k, m = min(4, len(a)), min(4, len(b))
            stop = a[len(a) - k :] + b[:m]
            if len(ids_a) == len(ids_b) == 1 and k and m and k + m >= 4:
                if plain["text"].find(stop) == text_before[j] - k:  # its first occurrence
                    chosen = (j, stop)
                    break
        assert chosen is not None, f"no token pair to build a straddling stop string from: {pieces[:20]}"
        j, stop = chosen
        body = {**COMPLETION, "stop": [stop]}
        uncut = read_all(client, stack.url, "/v1/completions", body)
    assert uncut["finish"] == ["stop"] and uncut["stop_reason"] == [stop]
    count = sum(len(ids) for ids, _ in pieces[:j])  # tokens through j-1: the cut falls after them
    resumed, tripwire = cut_run(stack, relays, "/v1/completions", body, count)
    assert tripwire.fired is not None
    assert (
        resumed["text"] == uncut["text"]
        and resumed["finish"] == ["stop"]
        and resumed["stop_reason"] == [stop]
    )
    assert resumed["usage"] == uncut["usage"] and resumed["done"] == 1
