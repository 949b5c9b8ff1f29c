"""The proxy's HTTP <-> core mapping, without sockets."""

from __future__ import annotations

import json

from picker.contract import Outcome, reply_for
from picker.proxy import translate


def test_hop_by_hop_and_hint_headers_do_not_cross() -> None:
    incoming = [
        ("Host", "proxy"),
        ("Connection", "keep-alive"),
        ("Transfer-Encoding", "chunked"),
        ("TE", "trailers"),
        ("Content-Length", "12"),
        ("x-gateway-inference-priority", "3"),
        ("x-picker-request-id", "forged"),
        ("Authorization", "Bearer k"),
        ("Content-Type", "application/json"),
    ]
    out = translate.upstream_headers(incoming, "abc")
    assert out == [
        ("Authorization", "Bearer k"),
        ("Content-Type", "application/json"),
        ("x-picker-request-id", "abc"),
    ]


def test_response_headers_name_who_served() -> None:
    upstream = [("content-type", "text/event-stream"), ("transfer-encoding", "chunked"), ("x-a", "1")]
    out = dict(translate.downstream_headers(upstream, "10.0.0.1:8000", "abc"))
    assert out == {
        "content-type": "text/event-stream",
        "x-a": "1",
        "x-gateway-destination-endpoint-served": "10.0.0.1:8000",
        "x-picker-request-id": "abc",
    }


def test_cut_tail_is_an_openai_error_event_then_done() -> None:
    reply = reply_for(Outcome.REJECTED_SHUTTING_DOWN)
    tail = translate.stream_cut_tail(reply, boundary=True)
    first, second, rest = tail.split(b"\n\n")
    assert first.startswith(b"data: ") and second == b"data: [DONE]" and rest == b""
    error = json.loads(first[len(b"data: ") :])["error"]
    assert error["reason"] == "rejected-shutting-down" and error["code"] == 503 and error["message"]
    # in the middle of an event: it is closed first, so the error event stands on its own
    assert translate.stream_cut_tail(reply, boundary=False).startswith(b"\n\ndata: ")
    assert translate.at_event_boundary(b'data: {"x":1}\n\n')
    assert not translate.at_event_boundary(b'data: {"x"')
