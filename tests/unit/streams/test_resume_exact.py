"""Resume, exact (issue 52): stop strings, logprobs, one role chunk, usage and what refuses at a cut.

Each test feeds a splice the engine's events as vLLM 0.32 writes them for the request the splice
sent upstream (with stop strings: `include_stop_str_in_output`, so the engine holds nothing back),
cuts it, feeds the continuation's events, and reads what the client got.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from picker.streams.resume import CHAT, COMPLETIONS, ResumeMode, Splice, prepare, refusal
from picker.streams.resume_fields import FIELDS, Handling, table

GREEDY = {"model": "m", "prompt": "hi", "stream": True, "temperature": 0, "max_tokens": 10}
CHAT_GREEDY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
               "temperature": 0, "max_tokens": 10}  # fmt: skip


def completion(
    ids: list[int],
    text: str,
    finish: str | None = None,
    *,
    prompt: list[int] | None = None,
    stop_reason: Any = None,
    logprobs: Any = None,
    usage: Any = None,
    rid: str = "a",
) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": stop_reason, "prompt_token_ids": prompt, "token_ids": ids}  # fmt: skip
    frame = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [choice],
             "usage": usage}  # fmt: skip
    return b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"


def chat(delta: dict[str, Any], ids: list[int] | None, finish: str | None = None, **top: Any) -> bytes:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if ids is not None:
        choice["token_ids"] = ids
    frame = {
        "id": "c",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
        **top,
    }
    return b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"


def frames(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(part[6:]) for part in out.split(b"\n\n") if part and part != b"data: [DONE]"]


def text_of(out: bytes) -> str:
    pieces = []
    for frame in frames(out):
        for choice in frame.get("choices") or []:
            pieces.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


def cut_and_continue(splice: Splice) -> dict[str, Any]:
    asked = splice.continuation()
    assert asked is not None
    path, body = asked
    splice.next_part(path)
    return body


def test_text_held_back_for_a_stop_string_survives_a_cut() -> None:
    sent, splice = prepare({**GREEDY, "stop": ["</answer>"]}, chat=False)
    assert sent["include_stop_str_in_output"] is True  # the engine holds nothing back: the splice does
    out = splice.feed(completion([7], " hello", prompt=[1, 2]) + completion([8], " world"))
    assert text_of(out) == " hel"  # vLLM's hold-back: the longest stop string less one character
    body = cut_and_continue(splice)
    assert body["prompt"] == [1, 2, 7, 8] and body["stop"] == ["</answer>"]
    out += splice.feed(completion([9], " again") + completion([10], " end", "length"))
    assert text_of(out) == " hello world again end"  # what an uncut run sends, none of it lost
    assert frames(out)[-1]["choices"][0]["finish_reason"] == "length"


def test_a_stop_string_the_engine_found_is_taken_out_where_the_client_did_not_ask_for_it() -> None:
    _, splice = prepare({**GREEDY, "stop": "STOP"}, chat=False)
    out = splice.feed(
        completion([7], " one", prompt=[1]) + completion([8], " two STOP", "stop", stop_reason="STOP")
    )
    assert text_of(out) == " one two " and splice.finished == "stop"
    _, kept = prepare({**GREEDY, "stop": "STOP", "include_stop_str_in_output": True}, chat=False)
    out = kept.feed(
        completion([7], " one", prompt=[1]) + completion([8], " two STOP", "stop", stop_reason="STOP")
    )
    assert text_of(out) == " one two STOP"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_straddling_the_cut_ends_the_stream_where_an_uncut_run_does(include: bool) -> None:
    body = {**GREEDY, "stop": ["END"], "stream_options": {"include_usage": True}}
    if include:
        body["include_stop_str_in_output"] = True
    _, splice = prepare(body, chat=False)
    out = splice.feed(completion([7], " xE", prompt=[1, 2]))  # "E" may begin the stop string
    cut_and_continue(splice)
    # the continuation's engine sees only its own text: "ND more" holds no stop string for it
    out += splice.feed(completion([8], "ND more", rid="b"))
    assert splice.ended_here and splice.done
    last = [f for f in frames(out) if f["choices"]][-1]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", "END")
    assert text_of(out) == (" xEND" if include else " x")
    assert frames(out)[-1]["usage"]["completion_tokens"] == 2


def test_completions_logprobs_continue_one_entry_per_token_with_offsets_of_the_client_s_text() -> None:
    def lp(tokens: list[str], start: int) -> dict[str, Any]:
        offsets = [start + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"text_offset": offsets, "token_logprobs": [-0.5] * len(tokens), "tokens": tokens,
                "top_logprobs": [{t: -0.5, " x": -2.0} for t in tokens]}  # fmt: skip

    _, splice = prepare({**GREEDY, "logprobs": 1}, chat=False)
    out = splice.feed(completion([7], " a", prompt=[1], logprobs=lp([" a"], 0)))
    out += splice.feed(completion([8], " bb", logprobs=lp([" bb"], 2)))
    body = cut_and_continue(splice)
    assert body["logprobs"] == 1  # it was dropped: 16 of 160 entries came back
    out += splice.feed(completion([9], " c", "length", logprobs=lp([" c"], 0), rid="b"))
    entries = [f["choices"][0]["logprobs"] for f in frames(out)]
    assert [e["tokens"] for e in entries] == [[" a"], [" bb"], [" c"]]
    assert [e["text_offset"] for e in entries] == [[0], [2], [5]]  # as an uncut run counts them


@pytest.mark.parametrize(
    ("asked", "expect_n", "expect_top"),
    [({"logprobs": True}, 0, 0), ({"logprobs": True, "top_logprobs": 2}, 2, 2)],
)
def test_chat_logprobs_continue_in_chat_s_shape(
    asked: dict[str, Any], expect_n: int, expect_top: int
) -> None:
    _, splice = prepare({**CHAT_GREEDY, **asked}, chat=True)
    out = splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))
    out += splice.feed(chat({"content": " a"}, [7]))
    body = cut_and_continue(splice)
    assert body["logprobs"] == expect_n and "top_logprobs" not in body
    lp = {"text_offset": [0], "token_logprobs": [-0.25], "tokens": [" b"],
          "top_logprobs": [{" b": -0.25, " q": -1.5, " r": -3.0}]}  # fmt: skip
    out += splice.feed(completion([8], " b", "length", logprobs=lp, rid="b"))
    last = frames(out)[-1]["choices"][0]
    assert last["delta"] == {"content": " b"} and last["finish_reason"] == "length"
    content = last["logprobs"]["content"]
    assert len(content) == 1 and content[0]["token"] == " b" and content[0]["logprob"] == -0.25
    assert content[0]["bytes"] == list(b" b") and len(content[0]["top_logprobs"]) == expect_top


def test_a_chat_stream_cut_before_its_role_chunk_still_gets_exactly_one() -> None:
    _, splice = prepare(CHAT_GREEDY, chat=True)
    out = splice.feed(b"")  # headers came, then the cut: nothing was sent
    asked = splice.continuation()
    assert asked is not None and asked[0] == CHAT  # nothing went out: the request as it was
    splice.next_part(asked[0])
    out += splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1]))
    out += splice.feed(chat({"content": " a"}, [7], "length"))
    roles = [f for f in frames(out) if "role" in f["choices"][0]["delta"]]
    assert len(roles) == 1


def test_a_chat_stream_cut_after_its_role_chunk_gets_no_second_one() -> None:
    _, splice = prepare(CHAT_GREEDY, chat=True)
    out = splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1]))
    splice.next_part(CHAT)  # cut before any token: the request as it was, on another replica
    out += splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1]))
    out += splice.feed(chat({"content": " a"}, [7], "length"))
    assert sum(1 for f in frames(out) if "role" in f["choices"][0]["delta"]) == 1


def test_continuous_usage_counts_the_client_s_prompt_and_every_part() -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    _, splice = prepare({**GREEDY, "stream_options": options}, chat=False)
    one = {"prompt_tokens": 2, "total_tokens": 3, "completion_tokens": 1}
    splice.feed(completion([7], " a", prompt=[1, 2], usage=one))
    body = cut_and_continue(splice)
    assert body["stream_options"] == options
    theirs = {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}  # ids sent became prompt
    out = splice.feed(completion([8], " b", usage=theirs, rid="b"))
    assert frames(out)[0]["usage"] == {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}


def test_reasoning_output_is_not_continued_as_content() -> None:
    _, splice = prepare(CHAT_GREEDY, chat=True)
    splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1]))
    splice.feed(chat({"reasoning_content": "think"}, [7]))
    assert splice.refused() == "reasoning-output" and splice.continuation() is None


def test_past_resume_max_tokens_the_ids_go_and_resume_is_refused() -> None:
    _, splice = prepare(GREEDY, chat=False, max_ids=4)
    splice.feed(completion([7], " a", prompt=[1, 2]) + completion([8], " b"))
    assert splice.refused() is None
    splice.feed(completion([9], " c"))
    assert splice.refused() == "too-long" and splice.sent == [] and splice.generated == 3
    assert splice.continuation() is None


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"prompt_logprobs": 1}, "prompt-logprobs"),
        ({"truncate_prompt_tokens": 5}, "truncate-prompt"),
        ({"stop": ["x"], "stop_token_ids": [3]}, "stop-strings-with-stop-tokens"),
        ({"stop": ["x"], "stop_token_ids": [3], "include_stop_str_in_output": True}, None),
        ({"stop_token_ids": [3]}, None),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv-transfer"),
        ({"logprobs": 2, "seed": 3, "logit_bias": {"5": 1}, "min_tokens": 2}, None),
    ],
)
def test_each_field_is_continued_or_refused_with_its_reason(change: dict[str, Any], why: str | None) -> None:
    assert refusal({**GREEDY, **change}, COMPLETIONS, ResumeMode.GREEDY, None) == why


def test_a_multimodal_chat_request_is_refused() -> None:
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}
    assert refusal({**CHAT_GREEDY, "messages": [image]}, CHAT, ResumeMode.GREEDY, None) == "multimodal"


def test_the_guide_s_table_names_every_field_once() -> None:
    rendered = table()
    for name, rule in FIELDS.items():
        assert sum(1 for line in rendered.splitlines() if line.startswith(f"| `{name}` |")) == 1
        assert (rule.handling is Handling.REFUSED) == bool(rule.reason)


def test_a_continuation_keeps_the_endpoint_s_default_length_where_the_client_set_none() -> None:
    """Completions without max_tokens stop at vLLM's 16; chat without one runs to the context's end.
    The continuation goes to the completions endpoint: it must say so itself."""
    plain = {k: v for k, v in GREEDY.items() if k != "max_tokens"}
    _, splice = prepare(plain, chat=False)
    splice.feed(completion([7], " a", prompt=[1]) + completion([8], " b"))
    assert cut_and_continue(splice)["max_tokens"] == 14
    chatty = {k: v for k, v in CHAT_GREEDY.items() if k != "max_tokens"}
    _, splice = prepare(chatty, chat=True)
    splice.feed(
        chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1]) + chat({"content": " a"}, [7])
    )
    body = cut_and_continue(splice)
    assert "max_tokens" in body and body["max_tokens"] is None


# --- a field's value as the engine reads it: 0 and 1 are no booleans, false is no count --------------


def vllm_completion(ids: list[int], text: str, logprobs: Any, prompt: list[int] | None = None) -> bytes:
    """A completions chunk in vLLM's own layout (its ids the last field: the splice's quick path)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": prompt, "token_ids": ids}  # fmt: skip
    frame = {"id": "a", "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"


@pytest.mark.parametrize("count", [0, False])
def test_completions_logprobs_zero_keeps_counting_offsets_across_a_cut(count: Any) -> None:
    """`logprobs: 0` asks for the chosen token's logprob alone (vLLM reads false as 0 too)."""

    def lp(token: str, offset: int) -> dict[str, Any]:
        return {"text_offset": [offset], "token_logprobs": [-0.5], "tokens": [token], "top_logprobs": None}

    _, splice = prepare({**GREEDY, "logprobs": count}, chat=False)
    out = splice.feed(vllm_completion([7], " a", lp(" a", 0), prompt=[1]))
    out += splice.feed(vllm_completion([8], " bb", lp(" bb", 2)))
    cut_and_continue(splice)
    out += splice.feed(completion([9], " c", "length", logprobs=lp(" c", 0), rid="b"))
    offsets = [f["choices"][0]["logprobs"]["text_offset"] for f in frames(out)]
    assert offsets == [[0], [2], [5]]  # as an uncut run counts them


@pytest.mark.parametrize("value", [1, "true", "on"])
def test_return_token_ids_set_as_the_engine_reads_it_keeps_the_clients_ids(value: Any) -> None:
    _, splice = prepare({**GREEDY, "return_token_ids": value}, chat=False)
    out = splice.feed(vllm_completion([7], " a", None, prompt=[1]))
    cut_and_continue(splice)
    out += splice.feed(completion([8], " b", "length", rid="b"))
    assert [f["choices"][0]["token_ids"] for f in frames(out)] == [[7], [8]]


@pytest.mark.parametrize("value", [1, "true", "yes"])
def test_include_stop_str_set_as_the_engine_reads_it_keeps_the_stop_string(value: Any) -> None:
    _, splice = prepare({**GREEDY, "stop": "STOP", "include_stop_str_in_output": value}, chat=False)
    out = splice.feed(
        completion([7], " one", prompt=[1]) + completion([8], " two STOP", "stop", stop_reason="STOP")
    )
    assert text_of(out) == " one two STOP"


@pytest.mark.parametrize("value", [0, "false", "off"])
def test_include_usage_off_as_the_engine_reads_it_sends_no_usage(value: Any) -> None:
    _, splice = prepare({**GREEDY, "stream_options": {"include_usage": value}}, chat=False)
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    last = {"id": "a", "object": "text_completion", "created": 1, "model": "m", "choices": [], "usage": usage}
    usage_chunk = b"data: " + json.dumps(last).encode() + b"\n\n"
    out = splice.feed(completion([7], " a", "length", prompt=[1]) + usage_chunk)
    assert len(frames(out)) == 1 and frames(out)[0].get("usage") is None


@pytest.mark.parametrize("value", [1, "true"])
def test_chat_logprobs_set_as_the_engine_reads_it_are_asked_of_the_continuation(value: Any) -> None:
    _, splice = prepare({**CHAT_GREEDY, "logprobs": value}, chat=True)
    splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))
    splice.feed(chat({"content": " a"}, [7]))
    assert cut_and_continue(splice)["logprobs"] == 0


@pytest.mark.parametrize(
    ("limits", "left"),
    [
        ({"max_tokens": 50, "max_completion_tokens": None}, 49),  # null: vLLM reads max_tokens
        ({"max_tokens": 50, "max_completion_tokens": 0}, 49),  # and 0 too (`or`)
        ({"max_tokens": 50, "max_completion_tokens": 30}, 29),  # the newer field wins
        ({"max_completion_tokens": 30}, 29),
        ({"max_tokens": 50}, 49),
    ],
)
def test_a_chat_continuation_asks_for_what_the_engine_read_as_the_limit_less_what_was_sent(
    limits: dict[str, Any], left: int
) -> None:
    """vLLM reads `max_completion_tokens or max_tokens`. Before: a `max_completion_tokens` key
    present but null made the continuation ask for the rest of the context, past the client's 50."""
    body = {k: v for k, v in CHAT_GREEDY.items() if k != "max_tokens"}
    _, splice = prepare({**body, **limits}, chat=True)
    splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))
    splice.feed(chat({"content": " a"}, [7]))
    rest = cut_and_continue(splice)
    assert rest["max_tokens"] == left and "max_completion_tokens" not in rest


@pytest.mark.parametrize("top", [2, "2", 2.0])
def test_chat_top_logprobs_as_the_engine_reads_it_are_asked_and_re_emitted(top: Any) -> None:
    """vLLM reads top_logprobs "2" (and 2.0) as 2. Before: anything but an int became 0, so the
    continuation asked no alternatives and re-emitted none."""
    body = {**CHAT_GREEDY, "logprobs": True, "top_logprobs": top}
    assert refusal(body, CHAT, ResumeMode.GREEDY, None) is None
    _, splice = prepare(body, chat=True)
    out = splice.feed(chat({"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2]))
    out += splice.feed(chat({"content": " a"}, [7]))
    assert cut_and_continue(splice)["logprobs"] == 2
    lp = {"text_offset": [0], "token_logprobs": [-0.25], "tokens": [" b"],
          "top_logprobs": [{" b": -0.25, " q": -1.5, " r": -3.0}]}  # fmt: skip
    out += splice.feed(completion([8], " b", "length", logprobs=lp, rid="b"))
    assert len(frames(out)[-1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2


@pytest.mark.parametrize("top", ["two", "2.5", " 2", "-1", True, 2.5, [2], {"n": 2}])
def test_chat_top_logprobs_the_picker_cannot_read_as_a_count_refuse_the_resume(top: Any) -> None:
    body = {**CHAT_GREEDY, "logprobs": True, "top_logprobs": top}
    assert refusal(body, CHAT, ResumeMode.GREEDY, None) == "top-logprobs"
