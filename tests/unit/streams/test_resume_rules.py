"""The rules of a stream resume (picker/streams/resume.py): what may be continued, and the splice."""

from __future__ import annotations

import json
from typing import Any

import pytest

from picker.streams.resume import CHAT, COMPLETIONS, ResumeMode, prepare, refusal

GREEDY = {"model": "m", "prompt": "hi", "stream": True, "temperature": 0, "max_tokens": 10}
STOP_TOKENS = "stop-strings-with-stop-tokens"
GREEDY_MODE = ResumeMode.GREEDY


@pytest.mark.parametrize(
    ("change", "mode", "asked", "why"),
    [
        ({}, ResumeMode.GREEDY, None, None),
        ({}, ResumeMode.OFF, None, "off"),
        ({}, ResumeMode.OFF, True, None),
        ({}, ResumeMode.ALWAYS, False, "refused-by-request"),
        ({"stream": False}, ResumeMode.GREEDY, None, "not-streaming"),
        ({"n": 2}, ResumeMode.GREEDY, None, "several-choices"),
        ({"echo": True}, ResumeMode.GREEDY, None, "echo"),
        ({"prompt": ["a", "b"]}, ResumeMode.GREEDY, None, "several-prompts"),
        ({"response_format": {"type": "json_object"}}, ResumeMode.GREEDY, None, "structured-output"),
        ({"frequency_penalty": 0.5}, ResumeMode.GREEDY, None, "penalties"),
        ({"temperature": 0.7}, ResumeMode.GREEDY, None, "sampling"),
        ({"temperature": 0.7}, ResumeMode.ALWAYS, None, None),
        ({"temperature": 0.7, "top_k": 1}, ResumeMode.GREEDY, None, None),
        # a boolean as the engine reads it: 0 and "false" are false, 1 and "true" true
        ({"stop": "x", "skip_special_tokens": 0}, ResumeMode.GREEDY, None, STOP_TOKENS),
        ({"stop": "x", "skip_special_tokens": "false"}, ResumeMode.GREEDY, None, STOP_TOKENS),
        ({"stop": "x", "skip_special_tokens": 0, "include_stop_str_in_output": 1}, GREEDY_MODE, None, None),
        ({"echo": "false"}, ResumeMode.GREEDY, None, None),
        ({"use_beam_search": 0}, ResumeMode.GREEDY, None, None),
    ],
)
def test_what_may_be_resumed(
    change: dict[str, Any], mode: ResumeMode, asked: bool | None, why: str | None
) -> None:
    assert refusal({**GREEDY, **change}, COMPLETIONS, mode, asked) == why


def test_tools_refuse_unless_the_request_turns_them_off() -> None:
    body = {**GREEDY, "messages": [], "tools": [{"type": "function"}]}
    assert refusal(body, CHAT, ResumeMode.GREEDY, None) == "tool-calls"
    assert refusal({**body, "tool_choice": "none"}, CHAT, ResumeMode.GREEDY, None) is None


def chunk(
    ids: list[int], finish: str | None = None, prompt: list[int] | None = None, rid: str = "a"
) -> bytes:
    choice = {"index": 0, "text": "".join(f" t{i}" for i in ids), "logprobs": None, "finish_reason": finish,
              "stop_reason": None, "prompt_token_ids": prompt, "token_ids": ids}  # fmt: skip
    frame = {"id": rid, "object": "text_completion", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(frame, separators=(",", ":")).encode() + b"\n\n"


def test_a_cut_stream_is_continued_from_its_ids_and_spliced_as_one() -> None:
    sent, splice = prepare({**GREEDY, "stream_options": {"include_usage": True}}, chat=False)
    assert sent["return_token_ids"] is True and sent["stream_options"] == {"include_usage": True}
    out = splice.feed(chunk([7], prompt=[1, 2]) + chunk([8]) + b'data: {"id":"a","cho')  # cut mid-event
    frames = [json.loads(line[6:]) for line in out.split(b"\n\n") if line]
    assert [f["choices"][0]["token_ids"] for f in frames] == [None, None]  # the client did not ask
    assert splice.sent == [7, 8] and not splice.done
    path, rest = splice.continuation()  # type: ignore[misc]
    assert path == COMPLETIONS and rest["prompt"] == [1, 2, 7, 8] and rest["max_tokens"] == 8
    splice.next_part(path)
    tail = splice.feed(chunk([9], prompt=[1, 2, 7, 8], rid="b") + chunk([10], "length", rid="b"))
    usage = b'data: {"id":"b","object":"text_completion","created":2,"model":"m","choices":[],'
    usage += b'"usage":{"prompt_tokens":4,"total_tokens":12,"completion_tokens":8}}\n\n'
    tail += splice.feed(usage + b"data: [DONE]\n\n")
    frames = [json.loads(line[6:]) for line in tail.split(b"\n\n") if line and line != b"data: [DONE]"]
    assert {f["id"] for f in frames} == {"a"} and {f["created"] for f in frames} == {1}
    assert frames[-1]["usage"] == {"prompt_tokens": 2, "total_tokens": 6, "completion_tokens": 4}
    assert splice.done and tail.endswith(b"data: [DONE]\n\n")


def test_an_end_lost_after_the_finish_is_written_locally_and_nothing_is_asked() -> None:
    _, splice = prepare({**GREEDY, "stream_options": {"include_usage": True}}, chat=False)
    splice.feed(chunk([7], prompt=[1, 2]) + chunk([8], "length"))
    end = splice.finish_locally()
    assert end is not None and end.endswith(b"data: [DONE]\n\n") and b'"completion_tokens":2' in end


def test_a_resumed_stream_moves_with_its_slot_even_where_the_load_looks_full() -> None:
    """The core's pick for a resume: never the replica that cut it, never a draining one; and a
    stream that already held a slot moves even when the others look saturated (a replica whose last
    scrape failed has a stale sample: `pick` calls it full): better queued on an engine than cut."""
    import random

    from picker.observability.metrics import Metrics
    from picker.pool import Pool
    from picker.pool.load import LoadSample
    from picker.request.inference import InferenceRequest
    from picker.request.pipeline import RequestPath
    from picker.scheduling import LoadPolicy

    clock = [100.0]
    pool = Pool(clock=lambda: clock[0])
    pool.apply(ready=["a:1", "b:1", "c:1"])
    for endpoint in pool.endpoints():
        endpoint.load = LoadSample(0.0, 0.0, 0.0, 99.0, 0, 0)
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=2, load_policy=LoadPolicy(), clock=lambda: clock[0],
        rng=random.Random(3), schedule=lambda delay, fn: lambda: None,
    )  # fmt: skip
    record = path.admit(
        InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)
    ).payload
    first = record.picked[0]
    path.response_started(record, 200, first, streaming=True)
    others = sorted({"a:1", "b:1", "c:1"} - {first})
    pool.apply(ready=[first, others[0]], draining=[others[1]])
    clock[0] += 60.0  # every sample is stale now: `pick` finds no room anywhere
    target = path.resume(record, first)
    in_flight = {e.address: e.in_flight for e in pool.endpoints()}
    assert target == others[0] and in_flight == {first: 0, others[0]: 1, others[1]: 0}
    assert path.resume(record, target) is None  # the draining one never; none left
