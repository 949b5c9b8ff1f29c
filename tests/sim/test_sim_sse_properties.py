"""Property tests: whatever the request and chunking, the SSE output parses the way vLLM's does."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import parity_checks as pc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from simkit import fast_config
from vllm_sim import LatencyConfig, run_sim

from loadtest import http_client
from loadtest.sse_client import SseParser, StreamResult, stream_request

ENDPOINTS = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion.chunk"}


def request_body(path: str, max_tokens: int, include_usage: bool, ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "stream": True, "ignore_eos": ignore_eos}
    if path == "/v1/completions":
        body["prompt"] = "x" * max_tokens
    else:
        body["messages"] = [{"role": "user", "content": "y" * max_tokens}]
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def one_stream(
    path: str, max_tokens: int, per_chunk: int, include_usage: bool, ignore_eos: bool, eos_rate: float
) -> tuple[StreamResult, dict[str, Any]]:
    latency = LatencyConfig(ttft_ms=0, itl_ms=0.2, tokens_per_chunk=per_chunk, eos_rate=eos_rate)
    async with (
        run_sim(fast_config(latency=latency)) as (replica,),
        http_client.AsyncClient(base_url=replica.url) as http,
    ):
        body = request_body(path, max_tokens, include_usage, ignore_eos)
        return await stream_request(http, path, body), body


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    path=st.sampled_from(sorted(ENDPOINTS)),
    max_tokens=st.integers(min_value=1, max_value=60),
    per_chunk=st.integers(min_value=1, max_value=9),
    include_usage=st.booleans(),
    ignore_eos=st.booleans(),
    eos_rate=st.sampled_from([0.0, 1.0]),
)
def test_stream_parses_like_vllm(
    path: str, max_tokens: int, per_chunk: int, include_usage: bool, ignore_eos: bool, eos_rate: float
) -> None:
    result, body = asyncio.run(one_stream(path, max_tokens, per_chunk, include_usage, ignore_eos, eos_rate))
    assert result.status == 200 and result.end == "done"
    payloads = pc.check_sse_frames(result.raw)  # every frame `data: <json>\n\n`, last `data: [DONE]`
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["object"] for c in chunks} == {ENDPOINTS[path]}
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    usage_chunks = [c for c in chunks if not c["choices"]]
    content = [c for c in chunks if c["choices"]]
    if path == "/v1/chat/completions":
        assert content[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        content = content[1:]
        texts = [c["choices"][0]["delta"]["content"] for c in content]
    else:
        texts = [c["choices"][0]["text"] for c in content]
        assert all(c["usage"] is None for c in content)
    tokens = sum(t.count(" tok") for t in texts)
    reasons = [c["choices"][0]["finish_reason"] for c in content]
    assert all(r is None for r in reasons[:-1])
    if ignore_eos or eos_rate == 0.0 or max_tokens == 1:
        assert tokens == max_tokens and reasons[-1] == "length"
    else:
        assert 1 <= tokens < max_tokens and reasons[-1] == "stop"
    assert all(1 <= t.count(" tok") <= per_chunk for t in texts)
    if include_usage:
        (usage_chunk,) = usage_chunks
        assert usage_chunk is chunks[-1]
        usage = usage_chunk["usage"]
        assert usage["completion_tokens"] == tokens
        assert usage["total_tokens"] == usage["prompt_tokens"] + tokens
    else:
        assert usage_chunks == []
    assert body["stream"] is True


@given(
    events=st.lists(
        st.text(
            alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"), max_size=30
        ),
        max_size=8,
    ),
    newline=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_sse_parser_is_split_invariant(events: list[str], newline: str, cuts: list[int]) -> None:
    """The client parser returns the same events however the byte stream is cut into reads."""
    wire = "".join(f"data: {e}{newline}{newline}" for e in events).encode()
    points = sorted({c for c in cuts if c < len(wire)})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    parser = SseParser()
    seen = [event for piece in pieces for event in parser.feed(piece)]
    assert seen == events


def test_sse_parser_does_not_split_on_unicode_line_breaks() -> None:
    parser = SseParser()
    assert parser.feed("data: a\u2028b\n\n".encode()) == ["a\u2028b"]
