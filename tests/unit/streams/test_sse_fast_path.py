"""The SSE parser's one-event fast path (issue 15) parses exactly as the general path does."""

from __future__ import annotations

import random

from picker.streams.sse import SSEEvent, SSEParser

CHUNKS = [
    b'data: {"choices":[{"text":" a","finish_reason":null}]}\n\n',
    b"data:no-space\n\n",
    b"data:\n\n",
    b"data: \n\n",
    b"event: error\n",
    b'data: {"error":{"message":"x"}}\n\n',
    b"data: split",
    b" across chunks\n\n",
    b"data: crlf\r\n\r\n",
    b"data: two\n\ndata: events\n\n",
    b": comment\n\n",
    b"data: trailing cr\r",
    b"\ndata: after cr\n\n",
    b"data: [DONE]\n\n",
]


def _events(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def test_whole_chunks_parse_as_byte_by_byte() -> None:
    rng = random.Random(15)
    for _ in range(200):
        chunks = [rng.choice(CHUNKS) for _ in range(rng.randint(1, 12))]
        one_byte_at_a_time = [bytes([b]) for b in b"".join(chunks)]
        assert _events(chunks) == _events(one_byte_at_a_time)


def test_fast_path_keeps_the_event_name_and_resets_it() -> None:
    parser = SSEParser()
    assert parser.feed(b"event: error\n") == []
    assert parser.feed(b"data: x\n\n") == [SSEEvent(b"x", "error")]
    assert parser.feed(b"data: y\n\n") == [SSEEvent(b"y", "")]
