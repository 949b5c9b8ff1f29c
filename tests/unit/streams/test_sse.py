from hypothesis import given, settings
from hypothesis import strategies as st

from picker.streams.sse import SSEEvent, SSEParser


def parse_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events = [e for chunk in chunks for e in parser.feed(chunk)]
    return events + parser.flush()


def test_vllm_stream_shape() -> None:
    raw = b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n'
    assert [e.data for e in parse_all([raw])] == [b'{"a":1}', b'{"b":2}', b"[DONE]"]


def test_line_endings_comments_fields_and_multiline_data() -> None:
    raw = b": keep-alive\r\nevent: error\r\ndata: x\rdata:y\n\nid: 7\ndata\n\n"
    assert parse_all([raw]) == [SSEEvent(b"x\ny", "error"), SSEEvent(b"")]


def test_crlf_split_across_chunks_is_one_line_end() -> None:
    assert parse_all([b"data: a\r", b"\n\r", b"\ndata: b\r\n\r\n"]) == [SSEEvent(b"a"), SSEEvent(b"b")]


def test_unicode_line_separators_are_data_not_line_ends() -> None:
    payload = "x\u2028y\u0085z".encode()
    assert parse_all([b"data: " + payload + b"\n\n"]) == [SSEEvent(payload)]


def test_incomplete_last_event_is_dropped() -> None:
    assert parse_all([b"data: a\n\ndata: b"]) == [SSEEvent(b"a")]


line_end = st.sampled_from([b"\n", b"\r\n", b"\r"])
field_value = st.binary(max_size=20).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    out = bytearray()
    for _ in range(draw(st.integers(0, 6))):
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from([b"data: ", b"data:", b": ", b"event: ", b"id: "]))
            out += kind + draw(field_value) + draw(line_end)
        out += draw(line_end)
    return bytes(out)


@settings(max_examples=300, deadline=None)
@given(raw=streams(), data=st.data())
def test_every_chunking_gives_the_same_events(raw: bytes, data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=12)))
    chunks = [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)], strict=True)]
    assert parse_all(chunks) == parse_all([raw])
    assert parse_all([bytes([b]) for b in raw]) == parse_all([raw])
