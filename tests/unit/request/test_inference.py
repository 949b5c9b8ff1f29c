import json

import pytest

from picker.contract import Outcome, Reply
from picker.request.inference import InferenceRequest, parse_request

JSON, BAD = "application/json", Outcome.BAD_REQUEST

LIMIT = 10_000


def parse(body: bytes, content_type: str | None = "application/json", method: str = "POST") -> object:
    return parse_request(method, "/v1/completions", content_type, body, LIMIT)


def test_reads_model_stream_and_sizes() -> None:
    body = json.dumps({"model": "m", "prompt": "hello", "stream": True, "max_tokens": 7}).encode()
    parsed = parse(body)
    assert isinstance(parsed, InferenceRequest)
    assert (parsed.model, parsed.stream, parsed.max_tokens, parsed.prompt_chars, parsed.body_bytes) == (
        "m",
        True,
        7,
        5,
        len(body),
    )


LIMITS = [
    ({"max_tokens": 50, "max_completion_tokens": 9}, 9),
    ({"max_tokens": None, "max_completion_tokens": 9}, 9),
    ({"max_tokens": 50, "max_completion_tokens": None}, 50),
    ({"max_tokens": 50}, 50),
]


@pytest.mark.parametrize(("limits", "read"), LIMITS)
def test_the_output_limit_is_the_one_the_engine_reads(limits: dict[str, int | None], read: int) -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **limits}
    parsed = parse(json.dumps(chat).encode())
    assert isinstance(parsed, InferenceRequest) and parsed.max_tokens == read


def test_chat_messages_count_as_prompt() -> None:
    body = json.dumps(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "abc"}, {"role": "user", "content": [{"type": "text"}]}],
        }
    )
    parsed = parse(body.encode())
    assert isinstance(parsed, InferenceRequest) and parsed.prompt_chars > 3


def test_content_type_with_charset_is_json() -> None:
    assert isinstance(parse(b'{"model":"m"}', "application/json; charset=utf-8"), InferenceRequest)
    assert isinstance(parse(b'{"model":"m"}', None), InferenceRequest)


def test_a_utf8_byte_order_mark_is_skipped() -> None:
    parsed = parse(b'\xef\xbb\xbf{"model": "m", "prompt": "hi"}')
    assert isinstance(parsed, InferenceRequest) and parsed.model == "m"


def test_get_without_body_is_routable() -> None:
    assert isinstance(parse(b"", None, "GET"), InferenceRequest)


@pytest.mark.parametrize(
    ("body", "content_type", "outcome", "fragment"),
    [
        (b"{not json", "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        (b"[1, 2]", "application/json", Outcome.BAD_REQUEST, "JSON object"),
        (b'{"prompt": "x"}', "application/json", Outcome.BAD_REQUEST, "model"),
        (b'{"model": ""}', "application/json", Outcome.BAD_REQUEST, "model"),
        (b'{"model": 3}', "application/json", Outcome.BAD_REQUEST, "model"),
        (b'{"model": "m", "max_tokens": "9"}', "application/json", Outcome.BAD_REQUEST, "max_tokens"),
        (b'{"model": "m", "max_tokens": true}', "application/json", Outcome.BAD_REQUEST, "max_tokens"),
        # each limit is checked, not only the one read first (a resume counts down the chat one)
        (b'{"model": "m", "max_tokens": 5, "max_completion_tokens": "7"}', JSON, BAD, "max_completion"),
        (b'{"model": "m", "max_tokens": null, "max_completion_tokens": true}', JSON, BAD, "max_completion"),
        (b'{"model": "m", "stream": "yes"}', "application/json", Outcome.BAD_REQUEST, "stream"),
        (b'{"model": "m"}', "text/plain", Outcome.BAD_REQUEST, "content-type"),
        (b"", "application/json", Outcome.BAD_REQUEST, "empty"),
        (b"\xff\xfe\x00", "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        (b"[" * 100_000, "application/json", Outcome.TOO_LARGE, "limit"),
        (b"[" * 9_000, "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        # JSON the engine cannot take either: a number out of range, NaN, a UTF-16 body, garbage after,
        # an unpaired surrogate (which failed here with a 500 before)
        (b'{"model": "m", "temperature": 1e400}', "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        (b'{"model": "m", "temperature": NaN}', "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        ('{"model": "m"}'.encode("utf-16"), "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        (b'{"model": "m"} {"model": "n"}', "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
        (b'{"model": "m", "prompt": "\\ud800"}', "application/json", Outcome.BAD_REQUEST, "not valid JSON"),
    ],
)
def test_bad_input_gets_a_contract_reply(
    body: bytes, content_type: str, outcome: Outcome, fragment: str
) -> None:
    parsed = parse(body, content_type)
    assert isinstance(parsed, Reply)
    assert parsed.outcome is outcome
    assert fragment in json.loads(parsed.body())["error"]["message"]
